// Internal to cpu_gemm_qdot*.cpp: the int16x2 kernels on AMX-INT8 (cpu_gemm_qdot16_amx.cpp), for
// row groups of up to 8 rows, from kAmxMinRows rows a call; cpu_gemm_qdot.cpp drives them. The same bits as the AVX2 kernels.
#pragma once

#include "cpu_gemm_qdot_kernels.h"

#ifdef PE_HAVE_QDOT
namespace pyengine::cpu::qdot {

constexpr int kAmxGroup = 8;  // rows a tile product takes: 2 limbs a row, 16 tile rows
// Fewer rows run the AVX-512 VNNI kernels: a block's tile work (loads, two products, two stores of
// the sums) costs ~100 cycles a panel however few rows it holds, which 4 vpdpwssd per 64 weights
// and row beat up to 3 rows (docs/kernels/cpu.md).
constexpr int kAmxMinRows = 4;

// AMX tile and int8 at run time, with Linux's permission for the tile state (asked once), and
// has_qdot16_avx512() (the float part runs on AVX-512).
bool has_qdot16_amx();
// rows (<= tile_rows <= kAmxGroup) quantised rows of x -> out, per block: A_l, 2 tile_rows rows of
// 32 bytes (row r's limb 1 at 2r, limb 2 at 2r + 1: the limbs' unsigned low bytes, inputs in
// order), then A_h (their signed high bytes), rows past `rows` zero. 4 tile_rows 32 bytes a block.
void amx_rows(const QRows& x, int rows, int tile_rows, int64_t blocks, uint8_t* out);
// The calling thread's tiles for groups of tile_rows rows, and their release.
void amx_begin(int tile_rows);
void amx_end();
// out [rows][16] = the group's first `rows` rows (xa: amx_rows' layout) against one panel.
void amx_panel(int bits, int rows, int tile_rows, const uint8_t* xa, const float* d, const float* sx, int64_t bs,
               const uint8_t* blk, int64_t blocks, float* out);

}  // namespace pyengine::cpu::qdot
#endif  // PE_HAVE_QDOT
