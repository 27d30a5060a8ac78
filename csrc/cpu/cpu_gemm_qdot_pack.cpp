// cpu_gemm_qdot.h: GGUF Q4_0 / Q4_1 / Q8_0 rows -> the integer-dot panels, and their columns back
// as fp32 rows (a tied embedding read from the lm_head's codes).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "common/common.h"
#include "cpu_gemm_qdot.h"
#include "cpu_thread_pool.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PE_HAVE_QDOT_PACK 1
#endif

namespace pyengine::cpu {

#ifdef PE_HAVE_QDOT_PACK
namespace {

#define PE_F16C __attribute__((target("f16c")))

constexpr int kPanel = kPanelCols;
constexpr int kRun = kAffineRun;

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

bool finite_half(uint16_t h) { return ((h >> 10) & 0x1F) != 0x1F; }

PE_F16C float half_value(uint16_t h) { return _cvtsh_ss(h); }

// Q4_0's offset -8 d as fp16 bits, or false where it is not an fp16 value (|d| > 8188).
PE_F16C bool q4_0_offset(uint16_t d, uint16_t& m) {
  const float want = -8.0f * _cvtsh_ss(d);
  m = _cvtss_sh(want, _MM_FROUND_TO_NEAREST_INT);
  return _cvtsh_ss(m) == want;
}

// Byte of input kk (0..31) of column c (0..15) in a block's code area (cpu_gemm_qdot.h's layout),
// and for 4-bit whether the column lives in the high nibble.
int64_t code_byte(int bits, int c, int kk) {
  const int group = kk / 4, lane = 4 * (c % 8) + kk % 4;
  return bits == 4 ? 32 * group + lane : 64 * group + 32 * (c / 8) + lane;
}

// Panel p (16 columns, `blocks` blocks) from GGUF rows into dst; false on a refused scale.
bool pack_panel(const GgufRows& src, int64_t blocks, int64_t p, int64_t n, uint8_t* dst) {
  const auto type = static_cast<GgufBlockType>(src.ggml_type);
  const int bits = type == GgufBlockType::kQ8_0 ? 8 : 4;
  const int64_t bytes = qdot_block_bytes(bits), scales = bits == 4 ? 64 : 32;
  const int file_bytes = type == GgufBlockType::kQ8_0 ? 34 : type == GgufBlockType::kQ4_1 ? 20 : 18;
  const int code_start = type == GgufBlockType::kQ4_1 ? 4 : 2;
  std::memset(dst, 0, static_cast<size_t>(blocks * bytes));  // padding columns: s = m = q = 0
  for (int c = 0; c < kPanel && p * kPanel + c < n; ++c) {
    const uint8_t* row = src.rows[p * kPanel + c];
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = row + b * file_bytes;
      uint8_t* out = dst + b * bytes;
      const uint16_t d = load_u16(blk);
      uint16_t m = 0;
      if (type == GgufBlockType::kQ4_1) m = load_u16(blk + 2);
      if (!finite_half(d) || !finite_half(m) || (type == GgufBlockType::kQ4_0 && !q4_0_offset(d, m))) return false;
      std::memcpy(out + 2 * c, &d, sizeof(d));
      if (bits == 4) std::memcpy(out + 32 + 2 * c, &m, sizeof(m));
      const uint8_t* g = blk + code_start;
      uint8_t* codes = out + scales;
      for (int kk = 0; kk < kRun; ++kk) {
        uint8_t& byte = codes[code_byte(bits, c, kk)];
        if (bits == 8) {
          byte = g[kk];
        } else {  // file byte j: input j (low nibble), input j + 16 (high nibble)
          const uint8_t code = kk < 16 ? (g[kk] & 0x0F) : (g[kk - 16] >> 4);
          byte |= c < 8 ? code : static_cast<uint8_t>(code << 4);
        }
      }
    }
  }
  return true;
}

}  // namespace

bool pack_gguf_qdot(const GgufRows& src, int64_t k, int64_t n, PanelStore& out) {
  if (gguf_panel_format(src.ggml_type) == PanelFormat::kDense || k % kRun != 0 || k <= 0 || n <= 0 || !has_qdot())
    return false;
  const int bits = gguf_panel_format(src.ggml_type) == PanelFormat::kAffine8 ? 8 : 4;
  const int64_t blocks = k / kRun, panels = ceil_div(n, kPanel), panel_bytes = blocks * qdot_block_bytes(bits);
  out.resize(static_cast<size_t>(panels * panel_bytes / 4));  // every byte written below
  auto* base = reinterpret_cast<uint8_t*>(out.data());
  std::atomic<bool> ok{true};
  constexpr int64_t kPanelsPerChunk = 8;  // chunks of a few tens of KiB: both cores busy, little waiting
  shared_pool().run_chunks(ceil_div(panels, kPanelsPerChunk), [&](int64_t chunk) {
    const int64_t end = std::min(panels, (chunk + 1) * kPanelsPerChunk);
    for (int64_t p = chunk * kPanelsPerChunk; p < end && ok.load(std::memory_order_relaxed); ++p)
      if (!pack_panel(src, blocks, p, n, base + p * panel_bytes)) ok.store(false);
  });
  return ok.load();
}

bool qdot_columns(const uint8_t* packed, int bits, int64_t k, int64_t n, const int64_t* ids, int64_t count,
                  float* out) {
  for (int64_t t = 0; t < count; ++t)  // before anything is written
    if (ids[t] < 0 || ids[t] >= n) return false;
  const int64_t blocks = k / kRun, bytes = qdot_block_bytes(bits), scales = bits == 4 ? 64 : 32;
  for (int64_t t = 0; t < count; ++t) {
    const int64_t p = ids[t] / kPanel;
    const int c = static_cast<int>(ids[t] % kPanel);
    const uint8_t* blk = packed + p * blocks * bytes;
    float* row = out + t * k;
    for (int64_t b = 0; b < blocks; ++b, blk += bytes, row += kRun) {
      const float s = half_value(load_u16(blk + 2 * c));
      const uint8_t* codes = blk + scales;
      if (bits == 8) {
        for (int kk = 0; kk < kRun; ++kk) row[kk] = s * static_cast<float>(static_cast<int8_t>(codes[code_byte(8, c, kk)]));
        continue;
      }
      const float m = half_value(load_u16(blk + 32 + 2 * c));
      for (int kk = 0; kk < kRun; ++kk) {
        const uint8_t byte = codes[code_byte(4, c, kk)];
        row[kk] = std::fma(s, static_cast<float>(c < 8 ? byte & 0x0F : byte >> 4), m);
      }
    }
  }
  return true;
}

#else

bool pack_gguf_qdot(const GgufRows&, int64_t, int64_t, PanelStore&) { return false; }
bool qdot_columns(const uint8_t*, int, int64_t, int64_t, const int64_t*, int64_t, float*) { return false; }

#endif  // PE_HAVE_QDOT_PACK

}  // namespace pyengine::cpu
