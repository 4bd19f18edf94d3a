// The 64-bit mixing the synthetic model writers (models/synth.cpp, models/synth_drafter.cpp) draw their
// values with. Fixed: a synthetic file is reproducible from its seed, across builds and releases.
#pragma once
#include <cstdint>
#include <string_view>

namespace dflash {

// SplitMix64's finaliser (Steele, Lea, Flood 2014): a bijective mix of every input bit into every output bit.
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// An FNV-1a-style pass over a name (a tensor's), started from `start` (the writers' own basis constant, one
// digit short of FNV's: kept, since the files depend on it).
inline uint64_t name_hash(std::string_view name, uint64_t start) {
  uint64_t h = 1469598103934665603ull ^ start;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace dflash
