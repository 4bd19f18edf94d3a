// dflash — the one binary: subcommands are registered in src/cli/commands.h.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <iostream>

#include "cli/commands.h"
#include "util/error.h"

int main(int argc, char** argv) {
  CLI::App app{"dflash: DFlash 2 speculative decoding engine (GGUF models)", "dflash"};
  app.set_version_flag("--version", std::string("dflash ") + dflash::cli::kVersion);
  app.require_subcommand(1);
  app.footer(
      "Run 'dflash COMMAND --help' for the options of a command.\n"
      "Exit status: 0 success; 1 error (bad input, a missing or invalid file, a model that fails to load);\n"
      "2 usage error (unknown command or option, missing or malformed argument).");

  dflash::cli::register_info(app);
  dflash::cli::register_quantize(app);
  dflash::cli::register_dump(app);
  dflash::cli::register_run(app);
  dflash::cli::register_synth(app);
  dflash::cli::register_bench(app);
  dflash::cli::register_synth_drafter(app);
  dflash::cli::register_draft(app);
  dflash::cli::register_convert(app);
  dflash::cli::register_tokenize(app);
  dflash::cli::register_serve(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);  // prints the usage error
    return 2;
  } catch (const dflash::Error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "dflash: error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fflush(stdout);
    std::fprintf(stderr, "dflash: error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "dflash: error: internal: %s\n", e.what());
    return 1;
  }
  return 0;
}
