// cpu_gguf_pack.h: GGUF Q4_0 / Q4_1 / Q8_0 rows -> compact panels, and packed columns -> rows.
#include "cpu_gguf_pack.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "common/common.h"
#include "cpu_thread_pool.h"

namespace pyengine::cpu {
namespace {

// IEEE fp16 -> fp32, exact (every fp16 value is an fp32 value); inf and NaN stay so.
float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  const uint32_t sign = static_cast<uint32_t>(h >> 15) << 31, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float f;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in fp32
    f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  const uint32_t bits = sign | (exp == 0x1F ? 0x7F800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

struct BlockLayout {
  int bytes;       // per block of 32 inputs
  int code_start;  // bytes before qs
};

BlockLayout layout_of(GgufBlockType t) {
  switch (t) {
    case GgufBlockType::kQ4_0: return {18, 2};
    case GgufBlockType::kQ4_1: return {20, 4};
    case GgufBlockType::kQ8_0: return {34, 2};
  }
  return {0, 0};
}

// One panel (16 output columns) of all K / 32 blocks (block b at dst + b * step words); false on a
// non-finite d or m.
bool pack_panel(const GgufRows& src, GgufBlockType type, int64_t blocks, int64_t p, int64_t n, uint32_t* dst,
                int64_t step) {
  const BlockLayout lay = layout_of(type);
  const PanelFormat f = gguf_panel_format(src.ggml_type);
  const int64_t words = affine_block_words(f);
  for (int64_t b = 0; b < blocks; ++b)  // padding columns: s = m = q = 0
    std::memset(dst + b * step, 0, static_cast<size_t>(words) * sizeof(uint32_t));
  for (int c = 0; c < kPanelCols && p * kPanelCols + c < n; ++c) {
    const uint8_t* row = src.rows[p * kPanelCols + c];
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = row + b * lay.bytes;
      uint32_t* block = dst + b * step;
      float* sm = reinterpret_cast<float*>(block);
      uint8_t* q = reinterpret_cast<uint8_t*>(block + 32);
      const float d = half_to_float(blk);
      const float m = type == GgufBlockType::kQ4_1 ? half_to_float(blk + 2) : type == GgufBlockType::kQ4_0 ? -8.0f * d : 0.0f;
      if (!std::isfinite(d) || !std::isfinite(m)) return false;
      sm[c] = d, sm[kPanelCols + c] = m;
      const uint8_t* g = blk + lay.code_start;
      if (f == PanelFormat::kAffine8) {
        for (int i = 0; i < kAffineRun; ++i) q[i * kPanelCols + c] = g[i];
      } else {  // panel line j holds inputs 2j (low nibble) and 2j + 1; file byte i holds inputs i and i + 16
        for (int j = 0; j < 8; ++j) {
          q[j * kPanelCols + c] = static_cast<uint8_t>((g[2 * j] & 0x0F) | (g[2 * j + 1] << 4));
          q[(j + 8) * kPanelCols + c] = static_cast<uint8_t>((g[2 * j] >> 4) | (g[2 * j + 1] & 0xF0));
        }
      }
    }
  }
  return true;
}

bool known(int32_t ggml_type) { return gguf_panel_format(ggml_type) != PanelFormat::kDense; }

}  // namespace

PanelFormat gguf_panel_format(int32_t ggml_type) {
  switch (static_cast<GgufBlockType>(ggml_type)) {
    case GgufBlockType::kQ4_0:
    case GgufBlockType::kQ4_1: return PanelFormat::kAffine4;
    case GgufBlockType::kQ8_0: return PanelFormat::kAffine8;
  }
  return PanelFormat::kDense;
}

bool pack_gguf_rows(const GgufRows& src, int64_t k, int64_t n, PanelStore& out, bool pair) {
  if (!known(src.ggml_type) || k % kAffineRun != 0 || k <= 0 || n <= 0) return false;
  const auto type = static_cast<GgufBlockType>(src.ggml_type);
  const AffineLayout lay(gguf_panel_format(src.ggml_type), k, n, pair);
  out.resize(static_cast<size_t>(lay.panels * lay.blocks * lay.words));  // every word written below
  std::atomic<bool> ok{true};
  constexpr int64_t kPanelsPerChunk = 8;  // chunks of a few tens of KiB: both cores busy, little waiting
  shared_pool().run_chunks(ceil_div(lay.panels, kPanelsPerChunk), [&](int64_t chunk) {
    const int64_t end = std::min(lay.panels, (chunk + 1) * kPanelsPerChunk);
    for (int64_t p = chunk * kPanelsPerChunk; p < end && ok.load(std::memory_order_relaxed); ++p)
      if (!pack_panel(src, type, lay.blocks, p, n, out.data() + lay.block(p, 0), lay.step(p))) ok.store(false);
  });
  return ok.load();
}

bool packed_columns(const uint32_t* panels, PanelFormat format, int64_t k, int64_t n, const int64_t* ids,
                    int64_t count, float* out, bool pair) {
  if (format == PanelFormat::kDense || k % kAffineRun != 0) return false;
  for (int64_t t = 0; t < count; ++t)  // before anything is written
    if (ids[t] < 0 || ids[t] >= n) return false;
  const AffineLayout lay(format, k, n, pair);
  const int64_t blocks = lay.blocks;
  for (int64_t t = 0; t < count; ++t) {
    const int64_t p = ids[t] / kPanelCols, c = ids[t] % kPanelCols;
    const uint32_t* block = panels + lay.block(p, 0);
    float* row = out + t * k;
    for (int64_t b = 0; b < blocks; ++b, block += lay.step(p), row += kAffineRun) {
      float s, m;
      std::memcpy(&s, block + c, sizeof(s));
      std::memcpy(&m, block + kPanelCols + c, sizeof(m));
      const uint8_t* q = reinterpret_cast<const uint8_t*>(block + 32) + c;
      if (format == PanelFormat::kAffine8) {
        for (int i = 0; i < kAffineRun; ++i) row[i] = s * static_cast<float>(static_cast<int8_t>(q[i * kPanelCols]));
      } else {  // line j: input 2j in the low nibble, 2j + 1 in the high one
        for (int j = 0; j < kAffineRun / 2; ++j) {
          const uint8_t byte = q[j * kPanelCols];
          row[2 * j] = std::fma(s, static_cast<float>(byte & 0x0F), m);
          row[2 * j + 1] = std::fma(s, static_cast<float>(byte >> 4), m);
        }
      }
    }
  }
  return true;
}

}  // namespace pyengine::cpu
