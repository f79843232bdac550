#!/usr/bin/env python3
"""PyTorch eager peer of deltamoe, for side-by-side CPU benchmarks.

A plain, self-contained PyTorch (eager mode) implementation of the deltamoe model family
(SPEC §1): KDA (chunked form), gated MLA, Block AttnRes or the plain residual, SiTU-GLU/SwiGLU
feed-forward blocks, latent MoE with a sigmoid router + selection bias, shared experts, final
norm, LM head, next-token cross-entropy. It reads our own model format: config.json in the K3
schema (also the Kimi-Linear / released dialect fields) + model.safetensors with the checkpoint
tensor names. Written for this comparison; no flash-linear-attention, no compiled kernels.

Subcommands:
  check         --model DIR                 logits / router choices / greedy vs DIR/golden.safetensors
  train-bench   --config C --batch B --seq T --steps N --threads n   fwd+bwd+AdamW tokens/s
  forward-bench --config C --batch B --seq T --steps N --threads n   no-grad forward tokens/s
Both benches print one JSON line.
"""
import argparse
import json
import math
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# ------------------------------------------------------------------------------------------------
# Config


class Cfg:
    """The subset of deltamoe's ModelConfig that defines the network (src/io/config.h)."""


def _kimi_default_mixers(L):
    # SPEC §1 default: MLA at every 4th layer (1-based) and at the last, KDA elsewhere.
    return ["mla" if ((i + 1) % 4 == 0 or i + 1 == L) else "kda" for i in range(L)]


def load_config(path):
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        top = json.load(f)
    t = top.get("text_config", top)
    if t is None:
        t = top
    declared_k3 = top.get("model_type") == "kimi_k3" or t.get("model_type") == "kimi_k3"
    if t.get("model_type") == "deepseek_v3" or top.get("model_type") == "deepseek_v3":
        raise SystemExit("deepseek_v3 configs are not supported by this peer")
    c = Cfg()
    c.vocab = int(t["vocab_size"])
    c.d = int(t["hidden_size"])
    c.L = int(t["num_hidden_layers"])
    c.eps = float(t.get("rms_norm_eps") or 1e-5)
    c.init_std = float(t.get("initializer_range") or 0.02)
    if t.get("tie_word_embeddings"):
        raise SystemExit("tie_word_embeddings=true is not supported")
    act = t.get("hidden_act") or "silu"
    if act not in ("silu", "swiglu", "situ"):
        raise SystemExit(f"unsupported hidden_act {act}")
    c.situ = act == "situ"
    c.beta1 = float(t.get("activation_situ_beta") or 4.0)
    c.beta2 = float(t.get("activation_situ_linear_beta") or 25.0)

    # token mixers
    lac = t.get("linear_attn_config") or None
    L = c.L
    if t.get("layer_types"):
        c.mixers = ["kda" if s == "linear_attention" else "mla" for s in t["layer_types"]]
    elif lac is not None and (lac.get("kda_layers") or lac.get("full_attn_layers")):
        c.mixers = ["kda"] * L
        for one_based in lac.get("full_attn_layers") or []:
            c.mixers[one_based - 1] = "mla"
    elif lac is not None:
        c.mixers = _kimi_default_mixers(L)
    else:
        c.mixers = ["mla"] * L
    lac = lac or {}
    c.kda_heads = int(lac.get("num_heads") or t.get("linear_num_heads") or 0)
    c.kda_dim = int(lac.get("head_dim") or t.get("linear_head_dim") or 0)
    c.conv = int(lac.get("short_conv_kernel_size") or t.get("linear_conv_kernel_dim") or 4)
    c.safe_gate = lac.get("gate_lower_bound") is not None
    c.gate_lb = float(lac["gate_lower_bound"]) if c.safe_gate else -5.0
    c.full_rank_gate = bool(lac.get("use_full_rank_gate", False))

    # channel mixers
    E = int(t.get("num_experts") or 0)
    if t.get("mlp_layer_types"):
        c.ffns = ["moe" if s == "sparse" else "dense" for s in t["mlp_layer_types"]]
    else:
        fk = int(t.get("first_k_dense_replace") or 0)
        freq = int(t.get("moe_layer_freq") or 1)
        c.ffns = ["moe" if (E > 0 and i >= fk and i % freq == 0) else "dense" for i in range(L)]
    c.dense_ffn = int(t.get("intermediate_size") or 0)
    c.E = E
    c.topk = int(t.get("num_experts_per_token") or 0)
    c.expert_ffn = int(t.get("moe_intermediate_size") or 0)
    c.n_shared = int(t.get("num_shared_experts") or 0)
    c.shared_ffn = int(t.get("shared_expert_intermediate_size") or c.expert_ffn)
    c.latent = int(t.get("routed_expert_hidden_size") or 0)
    c.latent_norm = bool(t.get("latent_moe_use_norm", False))
    c.n_group = int(t.get("num_expert_group") or 1)
    c.topk_group = int(t.get("topk_group") or 1)
    c.renorm = bool(t.get("moe_renormalize", True))
    c.scaling = float(t.get("routed_scaling_factor") or 1.0)
    c.router_std = float(t.get("router_initializer_range") or 0.006)

    # MLA
    c.mla_heads = int(t.get("num_attention_heads") or 0)
    c.q_lora = int(t.get("q_lora_rank") or 0)
    c.kv_lora = int(t.get("kv_lora_rank") or 0)
    c.nope = int(t.get("qk_nope_head_dim") or 0)
    c.rope = int(t.get("qk_rope_head_dim") or 0)
    c.vdim = int(t.get("v_head_dim") or 0)
    c.use_rope = not bool(t.get("mla_use_nope", True))
    c.mla_gate = bool(t.get("mla_use_output_gate", False))
    c.latent_eps = float(t.get("mla_latent_norm_eps") or 1e-6)
    rp = t.get("rope_parameters") or t.get("rope_scaling") or {}
    c.rope_theta = float(t.get("rope_theta") or rp.get("rope_theta") or 10000.0)
    if c.use_rope and (rp.get("rope_type") or rp.get("type") or "default") != "default":
        raise SystemExit("YaRN rope scaling is not supported by this peer")

    # residual
    c.attn_res_block = int(t.get("attn_res_block_size") or 0)

    # checkpoint tensor names (src/model/weights.cpp name_table)
    k3_features = (c.attn_res_block > 0 or c.situ or c.latent > 0 or c.latent_norm or c.mla_gate
                   or c.safe_gate or c.full_rank_gate)
    source = "kimi_k3" if (declared_k3 or k3_features) else "kimi_linear"
    source = t.get("source_model_type") or source
    naming = {"kimi_k3": "k3", "kimi_linear": "kimi_linear", "deepseek_v3": "deepseek_v3"}[source]
    c.naming = t.get("weight_naming") or naming
    return c


# ------------------------------------------------------------------------------------------------
# Parameter table: checkpoint name -> (shape, init, weight decay?, trainable?)


def param_table(c):
    if c.naming == "k3":
        m, lm_head, dense_mod, moe_mod, eg, eu, ed = ("language_model.model.", "language_model.lm_head.weight",
                                                      "mlp.", "block_sparse_moe.", "w1", "w3", "w2")
    elif c.naming == "kimi_linear":
        m, lm_head, dense_mod, moe_mod, eg, eu, ed = ("model.", "lm_head.weight", "block_sparse_moe.",
                                                      "block_sparse_moe.", "w1", "w3", "w2")
    else:
        m, lm_head, dense_mod, moe_mod, eg, eu, ed = ("model.", "lm_head.weight", "mlp.", "mlp.",
                                                      "gate_proj", "up_proj", "down_proj")
    d, V = c.d, c.vocab
    T = []  # (name, shape, init, decay, trainable)

    def add(name, shape, init, decay=True, trainable=True):
        T.append((name, tuple(shape), init, decay, trainable))

    add(m + "embed_tokens.weight", (V, d), "normal")
    for i in range(c.L):
        p = f"{m}layers.{i}."
        add(p + "input_layernorm.weight", (d,), "ones", False)
        add(p + "post_attention_layernorm.weight", (d,), "ones", False)
        if c.attn_res_block > 0:
            add(p + "self_attention_res_proj.weight", (1, d), "zeros", False)
            add(p + "self_attention_res_norm.weight", (d,), "ones", False)
            add(p + "mlp_res_proj.weight", (1, d), "zeros", False)
            add(p + "mlp_res_norm.weight", (d,), "ones", False)
        a = p + "self_attn."
        if c.mixers[i] == "kda":
            H, K, Kc = c.kda_heads, c.kda_dim, c.conv
            HK = H * K
            for n in ("q", "k", "v"):
                add(a + f"{n}_proj.weight", (HK, d), "normal")
            for n in ("q", "k", "v"):
                add(a + f"{n}_conv1d.weight", (HK, 1, Kc), "conv")
            add(a + "A_log", (H,), "alog", False)
            add(a + "f_a_proj.weight", (K, d), "normal")
            add(a + "f_b_proj.weight", (HK, K), "normal")
            add(a + "dt_bias", (HK,), "dtbias", False)
            add(a + "b_proj.weight", (H, d), "normal")
            if c.full_rank_gate:
                add(a + "g_proj.weight", (HK, d), "normal")
            else:
                add(a + "g_a_proj.weight", (K, d), "normal")
                add(a + "g_b_proj.weight", (HK, K), "normal")
            add(a + "o_norm.weight", (K,), "ones", False)
            add(a + "o_proj.weight", (d, HK), "normal_out")
        else:
            H, dq = c.mla_heads, c.nope + c.rope
            if c.q_lora > 0:
                add(a + "q_a_proj.weight", (c.q_lora, d), "normal")
                add(a + "q_a_layernorm.weight", (c.q_lora,), "ones", False)
                add(a + "q_b_proj.weight", (H * dq, c.q_lora), "normal")
            else:
                add(a + "q_proj.weight", (H * dq, d), "normal")
            add(a + "kv_a_proj_with_mqa.weight", (c.kv_lora + c.rope, d), "normal")
            add(a + "kv_a_layernorm.weight", (c.kv_lora,), "ones", False)
            add(a + "kv_b_proj.weight", (H * (c.nope + c.vdim), c.kv_lora), "normal")
            if c.mla_gate:
                add(a + "g_proj.weight", (H * c.vdim, d), "normal")
            add(a + "o_proj.weight", (d, H * c.vdim), "normal_out")
        if c.ffns[i] == "dense":
            f = p + dense_mod
            Fd = c.dense_ffn
            add(f + "gate_proj.weight", (Fd, d), "normal")
            add(f + "up_proj.weight", (Fd, d), "normal")
            add(f + "down_proj.weight", (d, Fd), "normal_out")
        else:
            f = p + moe_mod
            E, Fe = c.E, c.expert_ffn
            l = c.latent if c.latent else d
            add(f + "gate.weight", (E, d), "router")
            add(f + "gate.e_score_correction_bias", (E,), "zeros", False, False)
            for j in range(E):
                add(f + f"experts.{j}.{eg}.weight", (Fe, l), "normal")
                add(f + f"experts.{j}.{eu}.weight", (Fe, l), "normal")
                add(f + f"experts.{j}.{ed}.weight", (l, Fe), "normal_out")
            if c.n_shared > 0:
                Fs = c.n_shared * c.shared_ffn
                add(f + "shared_experts.gate_proj.weight", (Fs, d), "normal")
                add(f + "shared_experts.up_proj.weight", (Fs, d), "normal")
                add(f + "shared_experts.down_proj.weight", (d, Fs), "normal_out")
            if c.latent > 0:
                add(f + "routed_expert_down_proj.weight", (l, d), "normal")
                if c.latent_norm:
                    add(f + "routed_expert_norm.weight", (l,), "ones", False)
                add(f + "routed_expert_up_proj.weight", (d, l), "normal_out")
    add(m + "norm.weight", (d,), "ones", False)
    if c.attn_res_block > 0:
        add(m + "output_attn_res_proj.weight", (1, d), "zeros", False)
        add(m + "output_attn_res_norm.weight", (d,), "ones", False)
    add(lm_head, (V, d), "normal")
    names = dict(model=m, lm_head=lm_head, dense=dense_mod, moe=moe_mod, eg=eg, eu=eu, ed=ed)
    return T, names


def _key(name):
    return name.replace(".", "__")


# ------------------------------------------------------------------------------------------------
# Building blocks


def rmsnorm(x, w, eps):
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w).to(x.dtype)


def l2norm(z):
    return z * torch.rsqrt(z.pow(2).sum(-1, keepdim=True) + 1e-6)


def _kda_diag_blocks(qb, kb, Gb):
    """Diagonal sub-blocks: pairwise exponents Γi−Γj (j ≤ i), masked to −inf above the diagonal
    before the exp, so every exponent that reaches exp is ≤ 0."""
    sub = kb.shape[-2]
    diff = Gb.unsqueeze(-2) - Gb.unsqueeze(-3)                      # [..., ns, i, j, K]
    incl = torch.ones(sub, sub, dtype=torch.bool, device=kb.device).tril()
    diff = diff.masked_fill(~incl[:, :, None], float("-inf"))
    ekj = diff.exp() * kb.unsqueeze(-3)                              # e^{Γi−Γj} k_j
    qk_diag = (qb.unsqueeze(-2) * ekj).sum(-1)                       # [..., ns, sub, sub]
    kk_diag = (kb.unsqueeze(-2) * ekj).sum(-1)
    strict = torch.ones(sub, sub, dtype=torch.bool, device=kb.device).tril(-1)
    return qk_diag, kk_diag * strict


def kda_intra_chunk(q, k, G, sub):
    """Per chunk (last two dims [C, K]): returns
      KK[i, j] = Σ_d k_id k_jd e^{Γ_id − Γ_jd} for j < i (else 0),
      QK[i, j] = Σ_d q_id k_jd e^{Γ_id − Γ_jd} for j ≤ i (else 0),
    with every exponent ≤ 0 (SPEC §1.1: never form e^{−Γ} across a chunk). Inside a sub-chunk of
    `sub` tokens the pairwise exponents are formed directly (masked before exp); across sub-chunks
    the product is factored through the sub-chunk start r: e^{Γ_i−Γ_j} = e^{Γ_i−Γ_r}·e^{Γ_r−Γ_j},
    i ≥ r > j, so it is a matmul with both factors ≤ 1."""
    C, K = k.shape[-2], k.shape[-1]
    ns = C // sub
    lead = k.shape[:-2]
    qb = q.reshape(*lead, ns, sub, K)
    kb = k.reshape(*lead, ns, sub, K)
    Gb = G.reshape(*lead, ns, sub, K)
    # Diagonal sub-blocks: pairwise exponents [..., ns, sub, sub, K], the largest tensors of the
    # layer; under autograd they are recomputed in backward (activation checkpointing) instead of
    # being kept alive until then.
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or G.requires_grad):
        qk_diag, kk_diag = checkpoint(_kda_diag_blocks, qb, kb, Gb, use_reentrant=False)
    else:
        qk_diag, kk_diag = _kda_diag_blocks(qb, kb, Gb)
    kk_rows, qk_rows = [], []
    for a in range(ns):
        kk_parts, qk_parts = [], []
        if a > 0:
            r = Gb[..., a, 0:1, :]                                       # [..., 1, K]
            fi = torch.exp(Gb[..., a, :, :] - r)                         # i in block a: Γi−Γr ≤ 0
            kprev = k[..., : a * sub, :] * torch.exp(r - G[..., : a * sub, :])  # Γr−Γj ≤ 0
            kprev_t = kprev.transpose(-1, -2)
            kk_parts.append((kb[..., a, :, :] * fi) @ kprev_t)
            qk_parts.append((qb[..., a, :, :] * fi) @ kprev_t)
        kk_parts.append(kk_diag[..., a, :, :])
        qk_parts.append(qk_diag[..., a, :, :])
        if a < ns - 1:
            z = k.new_zeros(*lead, sub, C - (a + 1) * sub)
            kk_parts.append(z)
            qk_parts.append(z)
        kk_rows.append(torch.cat(kk_parts, -1))
        qk_rows.append(torch.cat(qk_parts, -1))
    return torch.cat(kk_rows, -2), torch.cat(qk_rows, -2)


def kda_chunked(q, k, v, g, beta, scale, chunk=64, sub=16, initial_state=None):
    """Chunked KDA (SPEC §1.1). q, k (already L2-normalised), g (log decay ≤ 0): [B,T,H,K];
    v: [B,T,H,V]; beta: [B,T,H]. Output o = scale · S_tᵀ q_t: [B,T,H,V]; final state [B,H,K,V]."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))          # [B,H,T,*]
    beta = beta.transpose(1, 2)                                       # [B,H,T]
    pad = (-T) % chunk
    if pad:  # padded tokens: k = v = β = 0, g = 0 → they leave the state untouched
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    n = (T + pad) // chunk
    C = chunk
    q = q.reshape(B, H, n, C, K)
    k = k.reshape(B, H, n, C, K)
    v = v.reshape(B, H, n, C, V)
    g = g.reshape(B, H, n, C, K)
    beta = beta.reshape(B, H, n, C, 1)
    G = g.cumsum(-2)                                                  # Γ (in-chunk cumsum)
    kk, qk = kda_intra_chunk(q, k, G, min(sub, C))
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    IL = eye + beta * kk                                              # I + L, unit lower triangular
    eG = G.exp()
    rhs = torch.cat([beta * k * eG, beta * v], -1)
    # fp32 solve: no bf16 triangular solve in torch (and fp32 is what chunked kernels use here)
    WU = torch.linalg.solve_triangular(IL.float(), rhs.float(), upper=False,
                                       unitriangular=True).to(rhs.dtype)
    Wm, Um = WU[..., :K], WU[..., K:]                                 # W = A·β·(K⊙e^Γ), U = A·β·V
    P = qk * scale
    qg = q * eG * scale
    gam = G[..., -1:, :]                                              # γ = Γ_C  [B,H,n,1,K]
    kdec = k * torch.exp(gam - G)                                     # K ⊙ e^{γ−Γ}, exponent ≤ 0
    edec = gam.exp().transpose(-1, -2)                                # [B,H,n,K,1]
    S = (initial_state.to(q.dtype) if initial_state is not None
         else q.new_zeros(B, H, K, V))
    outs = []
    for ci in range(n):
        Vp = Um[:, :, ci] - Wm[:, :, ci] @ S                          # V' = U − W·S
        outs.append(qg[:, :, ci] @ S + P[:, :, ci] @ Vp)
        S = edec[:, :, ci] * S + kdec[:, :, ci].transpose(-1, -2) @ Vp
    o = torch.stack(outs, 2).reshape(B, H, n * C, V)[:, :, :T]
    return o.transpose(1, 2), S


def kda_recurrent(q, k, v, g, beta, scale, initial_state=None):
    """Token-by-token reference of the same function (used only by the self-test)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = initial_state.clone() if initial_state is not None else q.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)
        kt, vt, bt = k[:, t], v[:, t], beta[:, t]
        err = vt - (S * kt.unsqueeze(-1)).sum(-2)                     # v − Sᵀk
        S = S + kt.unsqueeze(-1) * (bt.unsqueeze(-1) * err).unsqueeze(-2)
        outs.append((S * q[:, t].unsqueeze(-1)).sum(-2) * scale)
    return torch.stack(outs, 1), S


class SiTUGLU(torch.autograd.Function):
    """h = [β1·tanh(g/β1)·σ(g)] · [β2·tanh(u/β2)] with its analytic derivative; saves only g and u
    (the elementwise chain would otherwise keep ~6 intermediates of the expert width alive)."""

    @staticmethod
    def forward(ctx, g, u, b1, b2):
        ctx.save_for_backward(g, u)
        ctx.b = (b1, b2)
        return (b1 * torch.tanh(g / b1) * torch.sigmoid(g)) * (b2 * torch.tanh(u / b2))

    @staticmethod
    def backward(ctx, dh):
        g, u = ctx.saved_tensors
        b1, b2 = ctx.b
        tg, sg, tu = torch.tanh(g / b1), torch.sigmoid(g), torch.tanh(u / b2)
        a = b1 * tg * sg
        da = (1 - tg * tg) * sg + b1 * tg * sg * (1 - sg)
        bu = b2 * tu
        return dh * bu * da, dh * a * (1 - tu * tu), None, None


# ------------------------------------------------------------------------------------------------
# Model


class DeltaMoE(nn.Module):
    def __init__(self, cfg, chunk=64):
        super().__init__()
        self.c = cfg
        self.chunk = chunk
        self.table, self.names = param_table(cfg)
        self.p = nn.ParameterDict()
        for name, shape, _init, _decay, trainable in self.table:
            self.p[_key(name)] = nn.Parameter(torch.zeros(shape), requires_grad=trainable)
        self.trace = None  # dict to record intermediate tensors (check)

    def W(self, name):
        return self.p[_key(name)]

    # -- init / load ------------------------------------------------------------------------
    @torch.no_grad()
    def init_random(self, seed=1):
        c = self.c
        gen = torch.Generator().manual_seed(seed)
        out_std = c.init_std / math.sqrt(2.0 * max(1, c.L))
        for name, shape, init, _d, _t in self.table:
            w = self.W(name)
            if init == "normal":
                w.normal_(0.0, c.init_std, generator=gen)
            elif init == "normal_out":
                w.normal_(0.0, out_std, generator=gen)
            elif init == "router":
                w.normal_(0.0, c.router_std, generator=gen)
            elif init == "ones":
                w.fill_(1.0)
            elif init == "zeros":
                w.zero_()
            elif init == "conv":
                w.normal_(0.0, 1.0 / math.sqrt(shape[-1]), generator=gen)
            elif init == "alog":
                w.copy_(torch.log(1.0 + 15.0 * torch.rand(shape, generator=gen, dtype=torch.float64)))
            elif init == "dtbias":
                u = torch.rand(shape, generator=gen, dtype=torch.float64)
                dt = torch.exp(math.log(1e-3) + u * (math.log(0.1) - math.log(1e-3)))
                w.copy_(dt + torch.log(-torch.expm1(-dt)))
            else:
                raise AssertionError(init)

    @torch.no_grad()
    def load_safetensors(self, path):
        from safetensors import safe_open
        with safe_open(path, framework="pt") as f:
            have = set(f.keys())
            missing = []
            for name, shape, _i, _d, _t in self.table:
                if name not in have:
                    missing.append(name)
                    continue
                t = f.get_tensor(name)
                if name.endswith("A_log"):  # K3 pads to a multiple of 128; Kimi-Linear [1,1,H,1]
                    t = t.reshape(-1)[: shape[0]]
                self.W(name).copy_(t.reshape(shape).to(self.W(name).dtype))
                have.discard(name)
        if missing:
            raise SystemExit(f"{path}: missing tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        extra = [n for n in have if "mtp" not in n and "vision" not in n and "projector" not in n]
        if extra:
            print(f"note: {len(extra)} checkpoint tensors not used, e.g. {sorted(extra)[:3]}", file=sys.stderr)

    def _t(self, key, x):
        if self.trace is not None:
            self.trace[key] = x.detach()

    # -- sub-layers -------------------------------------------------------------------------
    def attnres(self, srcs, qname, nname):
        """AttnRes(V) = Σ_j softmax_j(Σ_d RMSNorm(V_j)_d γ_d w_d) · V_j, per token, no 1/√d."""
        if len(srcs) == 1:
            return srcs[0]
        wq = self.W(qname).reshape(-1) * self.W(nname)
        eps = self.c.eps
        logits = torch.stack([(s * wq).sum(-1) * torch.rsqrt(s.pow(2).mean(-1) + eps) for s in srcs], 0)
        pr = logits.softmax(0)
        out = pr[0].unsqueeze(-1) * srcs[0]
        for j in range(1, len(srcs)):
            out = out + pr[j].unsqueeze(-1) * srcs[j]
        return out

    def glu(self, x, wg, wu, wd):
        gt = F.linear(x, wg)
        up = F.linear(x, wu)
        c = self.c
        if c.situ:  # SiTU-GLU: [β1·tanh(g/β1)·σ(g)] · [β2·tanh(u/β2)]
            h = SiTUGLU.apply(gt, up, c.beta1, c.beta2)
        else:
            h = F.silu(gt) * up
        return F.linear(h, wd)

    def kda(self, x, i):
        c = self.c
        a = f"{self.names['model']}layers.{i}.self_attn."
        W = lambda n: self.W(a + n)  # noqa: E731
        B, T, _ = x.shape
        H, K, Kc = c.kda_heads, c.kda_dim, c.conv
        HK = H * K

        def conv_silu(n):
            y = F.linear(x, W(f"{n}_proj.weight")).transpose(1, 2)       # [B, HK, T]
            y = F.conv1d(F.pad(y, (Kc - 1, 0)), W(f"{n}_conv1d.weight"), groups=HK)
            return F.silu(y).transpose(1, 2).reshape(B, T, H, K)

        q = l2norm(conv_silu("q"))
        k = l2norm(conv_silu("k"))
        v = conv_silu("v")
        f = F.linear(F.linear(x, W("f_a_proj.weight")), W("f_b_proj.weight")) + W("dt_bias")
        f = f.reshape(B, T, H, K)
        A = W("A_log").exp().reshape(1, 1, H, 1)
        if c.safe_gate:
            g = c.gate_lb * torch.sigmoid(A * f)
        else:
            g = -A * F.softplus(f)
        beta = torch.sigmoid(F.linear(x, W("b_proj.weight")))              # [B,T,H]
        o, _ = kda_chunked(q, k, v, g, beta, K ** -0.5, chunk=self.chunk)
        o = rmsnorm(o, W("o_norm.weight"), c.eps)
        if c.full_rank_gate:
            gate = F.linear(x, W("g_proj.weight"))
        else:
            gate = F.linear(F.linear(x, W("g_a_proj.weight")), W("g_b_proj.weight"))
        o = o * torch.sigmoid(gate.reshape(B, T, H, K))
        return F.linear(o.reshape(B, T, HK), W("o_proj.weight"))

    def _rope(self, x, T):
        # interleaved pairs (2i, 2i+1), base θ; x [..., T, D] with T on dim 1
        D = x.shape[-1]
        inv = self.c.rope_theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        shape = [1] * x.dim()
        shape[1], shape[-1] = T, D // 2
        cos, sin = cos.reshape(shape), sin.reshape(shape)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).flatten(-2)

    def mla(self, x, i):
        c = self.c
        a = f"{self.names['model']}layers.{i}.self_attn."
        W = lambda n: self.W(a + n)  # noqa: E731
        B, T, _ = x.shape
        H, dn, dr, dv = c.mla_heads, c.nope, c.rope, c.vdim
        if c.q_lora > 0:
            q = F.linear(rmsnorm(F.linear(x, W("q_a_proj.weight")), W("q_a_layernorm.weight"), c.latent_eps),
                         W("q_b_proj.weight"))
        else:
            q = F.linear(x, W("q_proj.weight"))
        q = q.reshape(B, T, H, dn + dr)
        ckr = F.linear(x, W("kv_a_proj_with_mqa.weight"))
        cl, kr = ckr.split([c.kv_lora, dr], -1)
        cl = rmsnorm(cl, W("kv_a_layernorm.weight"), c.latent_eps)
        kv = F.linear(cl, W("kv_b_proj.weight")).reshape(B, T, H, dn + dv)
        kn, v = kv.split([dn, dv], -1)
        if c.use_rope and dr > 0:
            q = torch.cat([q[..., :dn], self._rope(q[..., dn:], T)], -1)
            kr = self._rope(kr, T)
        k = torch.cat([kn, kr.unsqueeze(2).expand(B, T, H, dr)], -1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=(dn + dr) ** -0.5)
        o = o.transpose(1, 2)                                             # [B,T,H,dv]
        if c.mla_gate:
            o = o * torch.sigmoid(F.linear(x, W("g_proj.weight"))).reshape(B, T, H, dv)
        return F.linear(o.reshape(B, T, H * dv), W("o_proj.weight"))

    def dense(self, x, i):
        f = f"{self.names['model']}layers.{i}.{self.names['dense']}"
        return self.glu(x, self.W(f + "gate_proj.weight"), self.W(f + "up_proj.weight"),
                        self.W(f + "down_proj.weight"))

    def moe(self, x, i):
        c = self.c
        nm = self.names
        f = f"{nm['model']}layers.{i}.{nm['moe']}"
        B, T, d = x.shape
        xf = x.reshape(-1, d)
        N, E, k = xf.shape[0], c.E, c.topk
        # router: sigmoid scores (fp32 or wider), selection on scores + bias, weights from scores
        scores = torch.sigmoid(F.linear(xf.float() if xf.dtype != torch.float64 else xf,
                                        self.W(f + "gate.weight").to(torch.float64 if xf.dtype == torch.float64 else torch.float32)))
        biased = scores.detach() + self.W(f + "gate.e_score_correction_bias")
        if c.n_group > 1 and c.topk_group < c.n_group:
            gs = biased.reshape(N, c.n_group, E // c.n_group)
            gscore = gs.topk(min(2, E // c.n_group), -1).values.sum(-1)
            keep = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, gscore.topk(c.topk_group, -1).indices, True)
            biased = biased.masked_fill(~keep.repeat_interleave(E // c.n_group, 1), float("-inf"))
        topi = biased.topk(k, -1).indices
        topi, _ = topi.sort(-1)                                            # ascending (as the goldens)
        w = scores.gather(1, topi)
        if c.renorm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = (w * c.scaling).to(x.dtype)
        if self.trace is not None:
            self.trace[f"router_idx_{i}"] = topi.detach()
            self.trace[f"router_w_{i}"] = w.detach()
        z = F.linear(xf, self.W(f + "routed_expert_down_proj.weight")) if c.latent > 0 else xf
        # grouped experts: sort (token, slot) pairs by expert, one GEMM chain per expert
        flat = topi.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // k
        wsorted = w.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=E).tolist()
        outs, start = [], 0
        for e in range(E):
            cnt = counts[e]
            if cnt == 0:
                continue
            te = tok[start:start + cnt]
            ye = self.glu(z.index_select(0, te), self.W(f + f"experts.{e}.{nm['eg']}.weight"),
                          self.W(f + f"experts.{e}.{nm['eu']}.weight"), self.W(f + f"experts.{e}.{nm['ed']}.weight"))
            outs.append(ye * wsorted[start:start + cnt, None])
            start += cnt
        u = z.new_zeros(N, z.shape[-1]).index_add(0, tok, torch.cat(outs, 0))
        if c.latent > 0:
            if c.latent_norm:
                u = rmsnorm(u, self.W(f + "routed_expert_norm.weight"), c.eps)
            y = F.linear(u, self.W(f + "routed_expert_up_proj.weight"))
        else:
            y = u
        if c.n_shared > 0:
            y = y + self.glu(xf, self.W(f + "shared_experts.gate_proj.weight"),
                             self.W(f + "shared_experts.up_proj.weight"), self.W(f + "shared_experts.down_proj.weight"))
        return y.reshape(B, T, d)

    # -- full model -------------------------------------------------------------------------
    def forward(self, ids):
        c = self.c
        m = self.names["model"]
        x0 = F.embedding(ids, self.W(m + "embed_tokens.weight"))
        self._t("embeddings", x0)

        def mixer(h, i):
            hn = rmsnorm(h, self.W(f"{m}layers.{i}.input_layernorm.weight"), c.eps)
            return self.kda(hn, i) if c.mixers[i] == "kda" else self.mla(hn, i)

        def ffn(h, i):
            hn = rmsnorm(h, self.W(f"{m}layers.{i}.post_attention_layernorm.weight"), c.eps)
            return self.moe(hn, i) if c.ffns[i] == "moe" else self.dense(hn, i)

        if c.attn_res_block > 0:
            # Block AttnRes, SPEC §1.3
            S = c.attn_res_block
            blocks, p = [], x0
            for i in range(c.L):
                pre = f"{m}layers.{i}."
                x = self.attnres(blocks + [p], pre + "self_attention_res_proj.weight",
                                 pre + "self_attention_res_norm.weight") if blocks else p
                if i % S == 0:
                    blocks.append(p)
                    p = None
                self._t(f"attn_in_{i}", x)
                a = mixer(x, i)
                self._t(f"attn_out_{i}", a)
                p = a if p is None else p + a
                y = self.attnres(blocks + [p], pre + "mlp_res_proj.weight", pre + "mlp_res_norm.weight")
                self._t(f"mlp_in_{i}", y)
                mo = ffn(y, i)
                self._t(f"mlp_out_{i}", mo)
                p = p + mo
                self._t(f"hidden_{i}", p)
            out = self.attnres(blocks + [p], m + "output_attn_res_proj.weight", m + "output_attn_res_norm.weight")
        else:
            h = x0
            for i in range(c.L):
                self._t(f"attn_in_{i}", h)
                a = mixer(h, i)
                self._t(f"attn_out_{i}", a)
                h = h + a
                self._t(f"mlp_in_{i}", h)
                mo = ffn(h, i)
                self._t(f"mlp_out_{i}", mo)
                h = h + mo
                self._t(f"hidden_{i}", h)
            out = h
        self._t("final_norm_in", out)
        hf = rmsnorm(out, self.W(m + "norm.weight"), c.eps)
        self._t("final_hidden", hf)
        return F.linear(hf, self.W(self.names["lm_head"]))

    def loss(self, ids):
        logits = self.forward(ids)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))

    def param_groups(self, wd):
        decay, no_decay = [], []
        for name, _s, _i, dec, trainable in self.table:
            if not trainable:
                continue
            (decay if dec else no_decay).append(self.W(name))
        return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]

    def num_params(self):
        return sum(p.numel() for p in self.p.values())


# ------------------------------------------------------------------------------------------------
# Commands


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300))


def cmd_check(args):
    from safetensors.torch import load_file
    torch.set_num_threads(args.threads)
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    cfg = load_config(args.model)
    model = DeltaMoE(cfg, chunk=args.chunk)
    model.load_safetensors(os.path.join(args.model, "model.safetensors"))
    model = model.to(dtype).eval()
    gold = load_file(os.path.join(args.model, "golden.safetensors"))
    ok = True
    print(f"model {args.model}: {model.num_params() / 1e6:.3f}M params, dtype {args.dtype}, KDA chunk {args.chunk}")
    with torch.no_grad():
        model.trace = {}
        logits = model(gold["input_ids"])
        tr = model.trace
        model.trace = None
    r = rel_rms(logits, gold["logits"])
    ok &= r <= args.tol
    print(f"logits: rel RMS {r:.3e} (tol {args.tol:.0e}) {'OK' if r <= args.tol else 'FAIL'}")
    if args.verbose:
        for key in sorted(gold.keys()):
            # (HF-style goldens number hidden_i differently: only the K3 golden layout is compared)
            if key in tr and key != "logits" and not key.startswith("router") and "embeddings" in gold:
                print(f"  {key:18s} rel RMS {rel_rms(tr[key], gold[key]):.3e}")
    # router choices
    n_layers = n_tok_mismatch = 0
    worst_w = 0.0
    for key in sorted(gold.keys()):
        if not key.startswith("router_idx_"):
            continue
        i = key[len("router_idx_"):]
        idx = tr[f"router_idx_{i}"].reshape(gold[key].shape)
        mism = int((idx != gold[key]).any(-1).sum())
        n_tok_mismatch += mism
        n_layers += 1
        wr = rel_rms(tr[f"router_w_{i}"].reshape(gold[f"router_w_{i}"].shape), gold[f"router_w_{i}"])
        worst_w = max(worst_w, wr)
        if args.verbose:
            print(f"  router layer {i}: {mism} tokens with different experts, weights rel RMS {wr:.3e}")
    if n_layers:
        rok = n_tok_mismatch == 0
        ok &= rok
        print(f"router: {n_layers} MoE layers, tokens with a different expert set: {n_tok_mismatch}; "
              f"worst weight rel RMS {worst_w:.3e} {'OK' if rok else 'FAIL'}")
    # greedy continuation (full re-forward per step, as the reference did)
    if "greedy_prompt" in gold and "greedy_output" in gold:
        seq = gold["greedy_prompt"].clone()
        steps = gold["greedy_output"].shape[1] - seq.shape[1]
        with torch.no_grad():
            for _ in range(steps):
                nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
                seq = torch.cat([seq, nxt], 1)
        same = bool(torch.equal(seq, gold["greedy_output"]))
        ok &= same
        print(f"greedy: {steps} tokens x {seq.shape[0]} rows {'identical' if same else 'DIFFERENT'}")
    # KDA operator goldens beside the model folder (chunked vs reference, float64)
    for opname in ("kda_op_small", "kda_op_long"):
        path = os.path.join(os.path.dirname(os.path.abspath(args.model.rstrip("/"))), opname + ".safetensors")
        if not os.path.exists(path):
            continue
        op = load_file(path)
        K = op["q"].shape[-1]
        for name, fn in (("chunked", lambda *a, **kw: kda_chunked(*a, chunk=args.chunk, **kw)),
                         ("recurrent", kda_recurrent)):
            ins = {n: op[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "s0")}
            with torch.enable_grad():
                o, sT = fn(l2norm(ins["q"]), l2norm(ins["k"]), ins["v"], ins["g"], ins["beta"], K ** -0.5,
                           initial_state=ins["s0"])
                ((o * op["do"]).sum() + (sT * op["dsT"]).sum()).backward()
            errs = {"o": rel_rms(o.detach(), op["o"]), "sT": rel_rms(sT.detach(), op["sT"])}
            for n in ins:
                errs["d" + n] = rel_rms(ins[n].grad, op["d" + n])
            worst = max(errs.values())
            good = worst <= 1e-9
            ok &= good
            print(f"{opname} ({name} + autograd, float64): worst rel RMS over o, sT, dq, dk, dv, dg, dbeta, ds0 "
                  f"{worst:.2e} {'OK' if good else 'FAIL'}")
    print("check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def cmd_bench(args, train):
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rss0 = peak_rss_mb()
    load0 = os.getloadavg()[0]
    cfg = load_config(args.config)
    model = DeltaMoE(cfg, chunk=args.chunk)
    model.init_random(args.seed)
    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = model.to(device=device, dtype=dtype)
    B, T = args.batch, args.seq
    ids = torch.randint(0, cfg.vocab, (B, T), generator=torch.Generator().manual_seed(args.seed + 1))
    ids = ids.to(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    times = []
    if train:
        model.train()
        opt = torch.optim.AdamW(model.param_groups(0.1), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
        losses = []
        for step in range(args.warmup + args.steps):
            sync()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = model.loss(ids)
            loss.backward()
            opt.step()
            sync()
            dt = time.perf_counter() - t0
            losses.append(float(loss.detach()))
            if step >= args.warmup:
                times.append(dt)
    else:
        model.eval()
        with torch.inference_mode():
            for step in range(args.warmup + args.steps):
                sync()
                t0 = time.perf_counter()
                model(ids).float().cpu()  # logits back on the host, as bench_cuda_model does
                dt = time.perf_counter() - t0
                if step >= args.warmup:
                    times.append(dt)
    med = statistics.median(times)
    res = {
        "peer": "pytorch-eager",
        "device": str(device),
        "dtype": args.dtype,
        "torch": torch.__version__,
        "threads": args.threads,
        "batch": B,
        "seq": T,
        "tokens_per_s": round(B * T / med, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "params": model.num_params(),
        "mode": "train" if train else "forward",
        "config": args.config,
        "steps": args.steps,
        "warmup": args.warmup,
        "ms_per_step_median": round(med * 1e3, 1),
        "ms_per_step_min": round(min(times) * 1e3, 1),
        "rss_after_import_mb": round(rss0, 1),
        "kda_chunk": args.chunk,
        # 1-minute load average before/after: other processes on the machine make timings noisy
        "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
    }
    if train:
        res["loss_first_last"] = [round(losses[0], 4), round(losses[-1], 4)]
    print(json.dumps(res))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    ck = sub.add_parser("check", help="compare with a golden folder (config.json, model.safetensors, golden.safetensors)")
    ck.add_argument("--model", required=True)
    ck.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ck.add_argument("--tol", type=float, default=1e-4)
    ck.add_argument("--chunk", type=int, default=64)
    ck.add_argument("--threads", type=int, default=2)
    ck.add_argument("-v", "--verbose", action="store_true")
    for name in ("train-bench", "forward-bench"):
        b = sub.add_parser(name)
        b.add_argument("--config", required=True)
        b.add_argument("--batch", type=int, default=1)
        b.add_argument("--seq", type=int, default=512)
        b.add_argument("--steps", type=int, default=10 if name == "train-bench" else 3)
        b.add_argument("--warmup", type=int, default=2)
        b.add_argument("--threads", type=int, default=2)
        b.add_argument("--chunk", type=int, default=64)
        b.add_argument("--seed", type=int, default=1)
        b.add_argument("--lr", type=float, default=1e-3)
        b.add_argument("--device", default="cpu", help="cpu or cuda")
        b.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args(argv)
    if args.cmd == "check":
        return cmd_check(args)
    return cmd_bench(args, train=args.cmd == "train-bench")


if __name__ == "__main__":
    sys.exit(main())
