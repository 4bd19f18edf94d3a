// dflash — the one binary: subcommands are registered in src/cli/commands.h.
#include <cstdio>

int main(int argc, char** argv) {
  std::fprintf(stderr, "dflash: no subcommands yet\n");
  return 1;
}
