// cpu_gemm_qdot.h, int16x2 activations on AMX-INT8 (calls of kAmxMinRows rows or more, in groups of
// up to kAmxGroup): the integer sums of cpu_gemm_qdot16.cpp from the tile unit, the float part as
// the AVX-512 kernels do it. Same bits.
//
// Why: on AVX-512 VNNI each row still costs 4 vpdpwssd per 64 weights, so a verify row of a
// speculative step adds ~0.45 of a decode step and prompts run at half the exact path's speed.
// One tile product sums 16 rows x 16 columns x 64 bytes.
//
// The integers: each int16 limb q = 256 h + l with l = q & 255 (unsigned byte) and h = q >> 8
// (signed byte, -128..127), so sum w q = 256 sum w h + sum w l, exactly (|sum| < 2^28). Per
// block of 32 inputs: C_l = A_l B (TDPBUSD: unsigned l bytes x signed codes), C_h = A_h B
// (TDPBSSD), A's rows (row r, limb 1 / 2) at 2r / 2r + 1, B the block's codes as one byte each in
// the panels' own order (4-bit: nibbles unpacked; 8-bit: the panel as stored). Then i = 256 C_h +
// C_l per limb, and the float fold, scale and offset sums of cpu_gemm_qdot16.cpp per lane.
#include "cpu_gemm_qdot_amx.h"

#ifdef PE_HAVE_QDOT
#include <asm/prctl.h>
#include <cstring>
#include <sys/syscall.h>
#include <unistd.h>

namespace pyengine::cpu::qdot {
namespace {

#define PE_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define PE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

constexpr int kXtileData = 18;  // XFEATURE_XTILEDATA: the tiles' state, requested from Linux once
// Tile numbers: literals for the intrinsics, which paste them into the instruction.
#define PE_TILE_A 0
#define PE_TILE_AH 1
#define PE_TILE_B 2
#define PE_TILE_C 3
#define PE_TILE_CH 4
#define PE_TILE_B1 5  // the second set, for odd blocks
#define PE_TILE_C1 6
#define PE_TILE_CH1 7

// LDTILECFG's 64-byte operand (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

PE_AMX void configure(int rows) {
  TileConfig cfg;
  for (const int t : {PE_TILE_A, PE_TILE_AH}) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = kRun;
  cfg.rows[PE_TILE_B] = kRun / 4, cfg.colsb[PE_TILE_B] = 64;
  cfg.rows[PE_TILE_B1] = kRun / 4, cfg.colsb[PE_TILE_B1] = 64;
  for (const int t : {PE_TILE_C, PE_TILE_CH, PE_TILE_C1, PE_TILE_CH1}) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;
  // not _tile_loadconfig: GCC 12's operand names 8 bytes of the 64, so the rest may be left unstored
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

// Block b's codes as tile B: 4-bit, the nibbles unpacked into buf (low: columns 0-7, high: 8-15).
#define PE_LOAD_B(TILE, buf)                                                                                        \
  if constexpr (Bits == 4) {                                                                                        \
    for (int g = 0; g < kRun / 4; ++g) {                                                                            \
      const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 + 32 * g))); \
      _mm512_store_si512(buf + 64 * g, _mm512_and_si512(_mm512_srlv_epi16(v, shift), low));                        \
    }                                                                                                               \
    _tile_loadd(TILE, buf, 64);                                                                                     \
  } else {                                                                                                          \
    _tile_loadd(TILE, blk + 32, 64);                                                                                \
  }
// Block b's two tile products into CL / CH (B in TILE_B).
#define PE_ISSUE(TILE_B, CL, CH, buf)                         \
  {                                                            \
    PE_LOAD_B(TILE_B, buf)                                     \
    _tile_loadd(PE_TILE_A, xa, kRun);                          \
    _tile_loadd(PE_TILE_AH, xa + 2 * tile_rows * kRun, kRun);  \
    _tile_zero(CL);                                            \
    _tile_zero(CH);                                            \
    _tile_dpbusd(CL, PE_TILE_A, TILE_B);                       \
    _tile_dpbssd(CH, PE_TILE_AH, TILE_B);                      \
  }
#define PE_DRAIN(CL, CH)     \
  _tile_stored(CL, cl, 64);  \
  _tile_stored(CH, ch, 64);

// Block bb's sums (cl, ch) into the accumulators, its scales at blk_b.
#define PE_READ_OUT(bb, blk_b)                                                                                     \
  {                                                                                                                \
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk_b)));                  \
    const __m512 m = Bits == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk_b + 32)))  \
                               : _mm512_setzero_ps();                                                              \
    _Pragma("GCC unroll 8") for (int r = 0; r < G; ++r) {                                                          \
      const __m512i i = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(ch + 32 * r), 8), _mm512_load_si512(cl + 32 * r)); \
      const __m512i j = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(ch + 32 * r + 16), 8),               \
                                         _mm512_load_si512(cl + 32 * r + 16));                                     \
      fold_block512<Bits>(i, j, s, m, d[r * bs + bb], sx[r * bs + bb], acc[r], accm[r]);                        \
    }                                                                                                              \
  }

// out [G][16] = the group's G rows against one panel. xa: the group's blocks in amx_rows' layout
// for tile_rows >= G rows (the tiles as amx_begin(tile_rows) configured them). Blocks alternate
// between two sets of B and C tiles, so that block b's products run while block b - 1's sums are
// read out (the tiles are not renamed: one set made every block wait for the last one's).
template <int G, int Bits>
PE_AMX void panel_amx(const uint8_t* xa, int tile_rows, const float* d, const float* sx, int64_t bs,
                      const uint8_t* blk, int64_t blocks, float* out) {
  constexpr int64_t kBytes = qdot_block_bytes(Bits);
  constexpr int kAhead = Bits == 4 ? 8 : 6;
  const int64_t group_bytes = 4 * tile_rows * kRun;
  alignas(64) uint8_t codes0[kRun / 4 * 64], codes1[kRun / 4 * 64];  // B of a 4-bit block: one byte a code
  alignas(64) int32_t cl[2 * kAmxGroup * 16], ch[2 * kAmxGroup * 16];
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  __m512 acc[G], accm[G];
#pragma GCC unroll 8
  for (int r = 0; r < G; ++r) acc[r] = accm[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, blk += kBytes, xa += group_bytes) {
    for (int line = 0; line < kBytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead * kBytes + line), _MM_HINT_T0);
    if (b % 2 == 0) {
      PE_ISSUE(PE_TILE_B, PE_TILE_C, PE_TILE_CH, codes0)
      if (b > 0) {
        PE_DRAIN(PE_TILE_C1, PE_TILE_CH1)
        PE_READ_OUT(b - 1, (blk - kBytes))
      }
    } else {
      PE_ISSUE(PE_TILE_B1, PE_TILE_C1, PE_TILE_CH1, codes1)
      PE_DRAIN(PE_TILE_C, PE_TILE_CH)
      PE_READ_OUT(b - 1, (blk - kBytes))
    }
  }
  if ((blocks - 1) % 2 == 0) {
    PE_DRAIN(PE_TILE_C, PE_TILE_CH)
  } else {
    PE_DRAIN(PE_TILE_C1, PE_TILE_CH1)
  }
  PE_READ_OUT(blocks - 1, (blk - kBytes))
#pragma GCC unroll 8
  for (int r = 0; r < G; ++r) _mm512_storeu_ps(out + 16 * r, Bits == 4 ? _mm512_add_ps(acc[r], accm[r]) : acc[r]);
}
#undef PE_READ_OUT
#undef PE_DRAIN
#undef PE_ISSUE
#undef PE_LOAD_B

template <int Bits>
using PanelFn = void (*)(const uint8_t*, int, const float*, const float*, int64_t, const uint8_t*, int64_t, float*);
template <int Bits>
constexpr PanelFn<Bits> kPanels[kAmxGroup] = {&panel_amx<1, Bits>, &panel_amx<2, Bits>, &panel_amx<3, Bits>,
                                              &panel_amx<4, Bits>, &panel_amx<5, Bits>, &panel_amx<6, Bits>,
                                              &panel_amx<7, Bits>, &panel_amx<8, Bits>};

bool request_tiles() {
  if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8")) return false;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, kXtileData) == 0;
}

}  // namespace

bool has_qdot16_amx() {
  static const bool ok = has_qdot16_avx512() && request_tiles();
  return ok;
}

PE_AVX512 void amx_rows(const QRows& x, int rows, int tile_rows, int64_t blocks, uint8_t* out) {
  // the quantiser's (x0, x2, x1, x3) int16 order per 4 inputs -> inputs in order
  const __m512i order = _mm512_set_epi16(31, 29, 30, 28, 27, 25, 26, 24, 23, 21, 22, 20, 19, 17, 18, 16, 15, 13, 14,
                                         12, 11, 9, 10, 8, 7, 5, 6, 4, 3, 1, 2, 0);
  for (int64_t b = 0; b < blocks; ++b, out += 4 * tile_rows * kRun) {
    std::memset(out + 2 * rows * kRun, 0, 2 * (tile_rows - rows) * kRun);  // rows past the group's: zero
    std::memset(out + 2 * (tile_rows + rows) * kRun, 0, 2 * (tile_rows - rows) * kRun);
    for (int r = 0; r < rows; ++r)
      for (int l = 0; l < 2; ++l) {
        const __m512i q = _mm512_permutexvar_epi16(order, _mm512_loadu_si512(x.q + r * x.qs + 64 * (2 * b + l)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (2 * r + l) * kRun), _mm512_cvtepi16_epi8(q));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (2 * tile_rows + 2 * r + l) * kRun),
                            _mm512_cvtepi16_epi8(_mm512_srai_epi16(q, 8)));
      }
  }
}

PE_AMX void amx_begin(int tile_rows) { configure(2 * tile_rows); }
PE_AMX void amx_end() { _tile_release(); }

void amx_panel(int bits, int rows, int tile_rows, const uint8_t* xa, const float* d, const float* sx, int64_t bs,
               const uint8_t* blk, int64_t blocks, float* out) {
  if (bits == 4)
    kPanels<4>[rows - 1](xa, tile_rows, d, sx, bs, blk, blocks, out);
  else
    kPanels<8>[rows - 1](xa, tile_rows, d, sx, bs, blk, blocks, out);
}

}  // namespace pyengine::cpu::qdot
#endif  // PE_HAVE_QDOT
