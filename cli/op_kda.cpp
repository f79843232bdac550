// `deltamoe op <name>`: runs one operator on tensors read from a safetensors file and writes its
// outputs to another (for checking the engine against reference implementations). The `op`
// command holds one sub-subcommand per operator; add new operators to setup_op_command.
//
//   deltamoe op kda --input IN.safetensors --output OUT.safetensors
//                   [--chunk 16|32|64|recurrent] [--dtype f32|f64]
//   IN:  q, k, g [B,T,H,K]; v [B,T,H,V]; beta [B,T,H]; s0 [B,H,K,V] (optional, zero if absent)
//        do [B,T,H,V] and dsT [B,H,K,V] (both optional; either one asks for gradients, the
//        other is then zero)
//   OUT: o [B,T,H,V]; sT [B,H,K,V] in the compute dtype (default: f64 if q is F64, else f32);
//        when `do` or `dsT` is given also the gradients of Σ o·do + Σ sT·dsT: dq, dk, dg [B,T,H,K]
//        (dq, dk w.r.t. the raw q, k), dv [B,T,H,V], dbeta [B,T,H], ds0 [B,H,K,V]
//        (computed by the backward of the form --chunk selects: chunked or BPTT).
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "command.h"
#include "core/arena.h"
#include "core/dtype.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "ops/cpu/kda.h"

namespace {

struct OpKdaOptions {
  std::string input_path;
  std::string output_path;
  std::string chunk = "64";
  std::string dtype;  // empty: follow the dtype of q
};

bool is_float_dtype(dm::DType t) {
  return t == dm::DType::F32 || t == dm::DType::F64 || t == dm::DType::BF16 ||
         t == dm::DType::F16;
}

// Fetches `name`, checking presence, float dtype and rank before any shape comparison so each
// failure names the tensor.
const dm::Tensor& op_kda_fetch(const dm::SafetensorsReader& reader, const std::string& name,
                               int expected_ndim) {
  DM_CHECK(reader.has(name), reader.path(), ": missing tensor '", name,
           "' (kda needs q, k, v, g, beta; s0, do, dsT are optional)");
  const dm::Tensor& t = reader.get(name);
  DM_CHECK(is_float_dtype(t.dtype), reader.path(), ": tensor '", name, "' has dtype ",
           dm::dtype_name(t.dtype), ", expected a float type");
  DM_CHECK(t.shape.ndim == expected_ndim, reader.path(), ": tensor '", name, "' has shape ",
           t.shape.str(), ", expected ", expected_ndim, " dimensions");
  return t;
}

// Any float tensor → contiguous vector of the compute type.
template <typename T>
std::vector<T> op_kda_convert(const dm::Tensor& t) {
  std::vector<T> out(size_t(t.numel()));
  if (t.dtype == dm::DType::F64) {
    const double* src = t.as<double>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = T(src[i]);
  } else {
    std::vector<float> as_f32(out.size());
    dm::convert_to_f32(t.data, t.dtype, as_f32.data(), as_f32.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = T(as_f32[i]);
  }
  return out;
}

struct OpKdaInputs {
  dm::KdaShape shape;
  const dm::Tensor *q, *k, *v, *g, *beta, *s0;  // s0 may be nullptr
  const dm::Tensor *d_o, *dsT;                   // optional: gradients wanted when either is given
};

OpKdaInputs op_kda_read_inputs(const dm::SafetensorsReader& reader) {
  OpKdaInputs in{};
  in.q = &op_kda_fetch(reader, "q", 4);
  in.v = &op_kda_fetch(reader, "v", 4);
  const dm::Shape& q_shape = in.q->shape;
  dm::KdaShape& s = in.shape;
  s.B = q_shape[0];
  s.T = q_shape[1];
  s.H = q_shape[2];
  s.K = q_shape[3];
  s.V = in.v->shape[3];
  DM_CHECK(s.K > 0, reader.path(), ": tensor 'q' has shape ", q_shape.str(),
           ", head dim K must be > 0");
  DM_CHECK(s.V > 0, reader.path(), ": tensor 'v' has shape ", in.v->shape.str(),
           ", head dim V must be > 0");
  // q defines B, T, H, K; everything else must agree with it (get_checked names the tensor).
  in.v = &reader.get_checked("v", {s.B, s.T, s.H, s.V});
  in.k = &op_kda_fetch(reader, "k", 4);
  in.k = &reader.get_checked("k", {s.B, s.T, s.H, s.K});
  in.g = &op_kda_fetch(reader, "g", 4);
  in.g = &reader.get_checked("g", {s.B, s.T, s.H, s.K});
  in.beta = &op_kda_fetch(reader, "beta", 3);
  in.beta = &reader.get_checked("beta", {s.B, s.T, s.H});
  in.s0 = nullptr;
  if (reader.has("s0")) {
    op_kda_fetch(reader, "s0", 4);
    in.s0 = &reader.get_checked("s0", {s.B, s.H, s.K, s.V});
  }
  in.d_o = in.dsT = nullptr;
  if (reader.has("do")) {
    op_kda_fetch(reader, "do", 4);
    in.d_o = &reader.get_checked("do", {s.B, s.T, s.H, s.V});
  }
  if (reader.has("dsT")) {
    op_kda_fetch(reader, "dsT", 4);
    in.dsT = &reader.get_checked("dsT", {s.B, s.H, s.K, s.V});
  }
  return in;
}

template <typename T>
void op_kda_run_typed(const OpKdaInputs& in, const OpKdaOptions& opts, dm::DType out_dtype) {
  const dm::KdaShape& s = in.shape;
  const std::vector<T> q = op_kda_convert<T>(*in.q), k = op_kda_convert<T>(*in.k),
                       v = op_kda_convert<T>(*in.v), g = op_kda_convert<T>(*in.g),
                       beta = op_kda_convert<T>(*in.beta);
  std::vector<T> s0;
  if (in.s0) s0 = op_kda_convert<T>(*in.s0);
  std::vector<T> o(size_t(s.B * s.T * s.H * s.V)), sT(size_t(s.B * s.H * s.K * s.V));
  const T scale = T(1) / std::sqrt(T(s.K));
  const T* s0_ptr = in.s0 ? s0.data() : nullptr;

  if (opts.chunk == "recurrent") {
    dm::kda_recurrent_forward<T>(q.data(), k.data(), v.data(), g.data(), beta.data(), s0_ptr,
                                 o.data(), sT.data(), s, scale);
  } else {
    const int chunk = std::stoi(opts.chunk);
    dm::Arena workspace(dm::kda_chunk_workspace_bytes<T>(s, chunk), "kda_workspace");
    dm::kda_chunk_forward<T>(q.data(), k.data(), v.data(), g.data(), beta.data(), s0_ptr,
                             o.data(), sT.data(), s, scale, chunk, workspace);
  }

  dm::SafetensorsWriter writer;
  writer.add("o", dm::Tensor{o.data(), out_dtype, {s.B, s.T, s.H, s.V}});
  writer.add("sT", dm::Tensor{sT.data(), out_dtype, {s.B, s.H, s.K, s.V}});

  // Gradients of Σ o·do + Σ sT·dsT, by the backward of the same form.
  const size_t n_qk = size_t(s.B * s.T * s.H * s.K), n_v = size_t(s.B * s.T * s.H * s.V);
  std::vector<T> dq, dk, dv, dg, dbeta, ds0;
  if (in.d_o || in.dsT) {
    std::vector<T> d_o(n_v, T(0));
    if (in.d_o) d_o = op_kda_convert<T>(*in.d_o);
    std::vector<T> dsT;
    if (in.dsT) dsT = op_kda_convert<T>(*in.dsT);
    const T* dsT_ptr = in.dsT ? dsT.data() : nullptr;
    dq.assign(n_qk, T(0));
    dk.assign(n_qk, T(0));
    dg.assign(n_qk, T(0));
    dv.assign(n_v, T(0));
    dbeta.assign(size_t(s.B * s.T * s.H), T(0));
    ds0.assign(size_t(s.B * s.H * s.K * s.V), T(0));
    if (opts.chunk == "recurrent") {
      dm::kda_recurrent_backward<T>(q.data(), k.data(), v.data(), g.data(), beta.data(), s0_ptr,
                                    d_o.data(), dsT_ptr, dq.data(), dk.data(), dv.data(),
                                    dg.data(), dbeta.data(), ds0.data(), s, scale);
    } else {
      const int chunk = std::stoi(opts.chunk);
      dm::Arena workspace(dm::kda_chunk_backward_workspace_bytes<T>(s, chunk),
                          "kda_backward_workspace");
      dm::kda_chunk_backward<T>(q.data(), k.data(), v.data(), g.data(), beta.data(), s0_ptr,
                                d_o.data(), dsT_ptr, dq.data(), dk.data(), dv.data(), dg.data(),
                                dbeta.data(), ds0.data(), s, scale, chunk, workspace);
    }
    writer.add("dq", dm::Tensor{dq.data(), out_dtype, {s.B, s.T, s.H, s.K}});
    writer.add("dk", dm::Tensor{dk.data(), out_dtype, {s.B, s.T, s.H, s.K}});
    writer.add("dv", dm::Tensor{dv.data(), out_dtype, {s.B, s.T, s.H, s.V}});
    writer.add("dg", dm::Tensor{dg.data(), out_dtype, {s.B, s.T, s.H, s.K}});
    writer.add("dbeta", dm::Tensor{dbeta.data(), out_dtype, {s.B, s.T, s.H}});
    writer.add("ds0", dm::Tensor{ds0.data(), out_dtype, {s.B, s.H, s.K, s.V}});
  }
  writer.set_metadata("op", "kda");
  writer.set_metadata("chunk", opts.chunk);
  writer.write(opts.output_path);
}

void op_kda_run(const OpKdaOptions& opts) {
  const dm::SafetensorsReader reader = dm::SafetensorsReader::open(opts.input_path);
  const OpKdaInputs in = op_kda_read_inputs(reader);
  const bool use_f64 = opts.dtype.empty() ? in.q->dtype == dm::DType::F64 : opts.dtype == "f64";
  if (use_f64) op_kda_run_typed<double>(in, opts, dm::DType::F64);
  else op_kda_run_typed<float>(in, opts, dm::DType::F32);
  const dm::KdaShape& s = in.shape;
  std::printf("kda: B=%lld T=%lld H=%lld K=%lld V=%lld chunk=%s dtype=%s%s -> %s\n",
              (long long)s.B, (long long)s.T, (long long)s.H, (long long)s.K, (long long)s.V,
              opts.chunk.c_str(), use_f64 ? "f64" : "f32", in.d_o || in.dsT ? " backward" : "",
              opts.output_path.c_str());
}

void setup_op_kda(CLI::App* sub) {
  auto opts = std::make_shared<OpKdaOptions>();
  sub->add_option("--input", opts->input_path,
                  "safetensors with q, k, v, g, beta, (s0), (do, dsT: also write gradients)")
      ->required();
  sub->add_option("--output", opts->output_path, "safetensors to write o, sT to")->required();
  sub->add_option("--chunk", opts->chunk, "chunk length, or 'recurrent' (default 64)")
      ->check(CLI::IsMember({"16", "32", "64", "recurrent"}));
  sub->add_option("--dtype", opts->dtype, "compute/output dtype (default: f64 if q is F64)")
      ->check(CLI::IsMember({"f32", "f64"}));
  sub->callback([opts] { op_kda_run(*opts); });
}

void setup_op_command(CLI::App* app) {
  app->require_subcommand(1);
  setup_op_kda(app->add_subcommand(
      "kda", "Kimi Delta Attention forward (o, final state); backward too when 'do' is given"));
}

dm::cli::Registrar op_registrar("op", "Run one operator on tensors from a safetensors file",
                                setup_op_command);

}  // namespace
