// Tile configurations of the MLA decode kernels: the fast tile runs with tensor cores in ~226 KB of
// shared memory on sm_90a (mla_decode_fast.hip, warpgroup roles), the small one with FMA products in
// under 64 KB elsewhere (mla_decode_small.hip; AMD gfx90a has 64 KB per block). Both use the same
// fixed key ranges (mla_ranges.h), masking, softmax and merge. Device-independent: included by the
// kernel files only.
#pragma once

namespace pe_mla {

constexpr int kDqk = 576;
constexpr int kDv = 512;
constexpr int kChunks = kDqk / 8;  // 16-byte chunks per row

// Tile sizes. kWarps warps per group: 16 kWarps query-head pairs per block, the rows of every
// product; kGroups groups (in the small tile's kernel group wg owns keys kNS wg .. +kNS of each tile
// in S and value columns kNO wg .. +kNO in O; the fast tile's two warpgroups take roles instead);
// kN keys per tile in kStages shared-memory stages.
template <int kWarps_, int kGroups_, int kN_, int kStages_>
struct MlaTile {
  static constexpr int kWarps = kWarps_, kGroups = kGroups_, kN = kN_, kStages = kStages_;
  static constexpr int kM = 16 * kWarps;
  static constexpr int kThreads = 32 * kWarps * kGroups;
  static constexpr int kNS = kN / kGroups, kNO = kDv / kGroups;
  static constexpr int kTpr = kThreads / kN;   // copy threads per key
  static constexpr int kTprQ = kThreads / kM;  // copy threads per query row
  static constexpr int kQElems = kM * kDqk, kKElems = kN * kDqk;
  static constexpr int kPElems = kM * ((kN + 63) / 64 * 64);  // a slab row is 64 wide (swizzle)
  // + 1024: the tiles start at a 1024-byte boundary (align_1024); (2 kGroups + 1) kM floats: the
  // per-row exchanges (small tile: sMax, sSum; fast tile: sScale and two ranges' sSum, sMx).
  static constexpr int kFloats = (2 * kGroups + 1) * kM;
  static constexpr int kSmemBytes =
      1024 + (kQElems + kStages * kKElems + kPElems) * 2 + kFloats * (int)sizeof(float);
  static_assert(kThreads == kTpr * kN && kThreads == kTprQ * kM && kChunks % kTpr == 0 &&
                kChunks % kTprQ == 0, "copy layout");
  static_assert(kNS % 8 == 0 && kNO % 8 == 0 && kN % 16 == 0 && kNO * kGroups == kDv, "product layout");
  static_assert(kStages == 1 || kStages == 2, "pipeline");
};
// 64 pairs, 2 warpgroups, 2 stages of 64 keys: ~226 KB (sm_90a, tensor cores).
using FastTile = MlaTile<4, 2, 64, 2>;
// 16 pairs, 4 one-warp groups, 1 stage of 32 keys: 57.5 KB, FMA products. For AMD gfx90a (64 KB
// per block) and anything else without the fast tile's shared memory; runs on an H100 for the tests.
using SmallTile = MlaTile<1, 4, 32, 1>;
static_assert(FastTile::kSmemBytes <= 227 * 1024, "fast tile: the H100's opt-in maximum per block");
static_assert(SmallTile::kSmemBytes <= 64 * 1024, "small tile must fit AMD gfx90a's 64 KB per block");

}  // namespace pe_mla
