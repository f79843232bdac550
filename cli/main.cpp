// deltamoe: one CLI, many subcommands (see cli/*.cpp). Exit code 0 on success, 1 on any user
// error (one line on stderr naming the file / tensor / field), 2 on bad command-line usage.
#include <algorithm>
#include <cstdio>
#include <exception>

#include "command.h"
#include "core/error.h"
#include "core/gemm.h"

namespace dm::cli {
std::vector<Command>& registry() {
  static std::vector<Command> r;
  return r;
}
}  // namespace dm::cli

int main(int argc, char** argv) {
  dm::blas_ensure_fast_kernels(argc, argv);
  CLI::App app{"deltamoe: train, post-train and serve KDA/MLA hybrid MoE language models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "deltamoe 0.1.0");
  int threads = 0;
  app.add_option("--threads", threads, "CPU threads (default: all cores)");
  auto& cmds = dm::cli::registry();
  std::sort(cmds.begin(), cmds.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  for (const auto& c : cmds) c.setup(app.add_subcommand(c.name, c.help));
  app.parse_complete_callback([&] { dm::set_num_threads(threads); });
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);  // prints the message
    return 2;
  } catch (const dm::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
