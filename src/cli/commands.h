// The `dflash` subcommands. Each command lives in its own file cmd_<name>.cpp and defines
// register_<name>(CLI::App&), which adds a subcommand with its options and a callback; main.cpp calls
// every register_* function listed here. To add a command: write cmd_<name>.cpp, declare its
// register function below, and call it in main.cpp.
//
// Conventions: callbacks report bad input by throwing dflash::Error (main prints
// "dflash: error: <what>" and exits 1); CLI11 usage errors exit 2.
#pragma once

namespace CLI {
class App;
}

namespace dflash::cli {

void register_info(CLI::App& app);      // cmd_info.cpp: header, metadata, tensor table of a GGUF file
void register_quantize(CLI::App& app);  // cmd_quantize.cpp: re-quantize the weights of a GGUF file
void register_dump(CLI::App& app);      // cmd_dump.cpp: one tensor dequantized to f32
void register_run(CLI::App& app);       // cmd_run.cpp: greedy generation, plain or speculative
void register_synth(CLI::App& app);     // cmd_synth.cpp: random-weight target models
void register_bench(CLI::App& app);     // cmd_bench.cpp: prefill / decode / verify / speculative speed table
void register_synth_drafter(CLI::App& app);  // cmd_synth_drafter.cpp: random-weight DFlash drafters
void register_draft(CLI::App& app);     // cmd_draft.cpp: one traced drafter forward (the z-lab oracle)
void register_convert(CLI::App& app);   // cmd_convert.cpp: Hugging Face checkpoint -> GGUF
void register_tokenize(CLI::App& app);  // cmd_tokenize.cpp: tokenize / detokenize with a model's tokenizer
void register_serve(CLI::App& app);     // cmd_serve.cpp: OpenAI-compatible HTTP server

// Version string printed by `dflash --version`.
constexpr const char* kVersion = "0.1.0";

}  // namespace dflash::cli
