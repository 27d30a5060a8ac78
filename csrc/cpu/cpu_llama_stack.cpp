// cpu_llama_stack.h: the op-by-op layer of pyengine/models/llama.py as one C++ loop.
#include "cpu_llama_stack.h"

#include <cstring>
#include <utility>

#include "common/common.h"

namespace pyengine::cpu {
namespace {

size_t element_size(DType dtype) { return dtype == DType::kBFloat16 ? 2 : 4; }

// Scratch rows of one step: x, o [T, hidden], qkv [T, (Hq + 2 Hkv) D], attention [T, Hq D],
// gate|up [T, 2 I], activation [T, I]; one allocation per step.
struct Scratch {
  std::vector<unsigned char> bytes;
  unsigned char* qkv;
  unsigned char* attn;
  unsigned char* o;
  unsigned char* gate_up;
  unsigned char* act;

  Scratch(int64_t tokens, int64_t hidden, int64_t qkv_width, int64_t q_width, int64_t inter, size_t elem) {
    const int64_t widths[] = {qkv_width, q_width, hidden, 2 * inter, inter};
    int64_t total = 0;
    for (const int64_t w : widths) total += tokens * w;
    bytes.resize(static_cast<size_t>(total) * elem);
    unsigned char* at = bytes.data();
    unsigned char** slots[] = {&qkv, &attn, &o, &gate_up, &act};
    for (int i = 0; i < 5; ++i) *slots[i] = at, at += static_cast<size_t>(tokens * widths[i]) * elem;
  }
};

}  // namespace

LlamaStack::LlamaStack(std::vector<LlamaLayerWeights> layers, int32_t hidden, int32_t num_heads, int32_t num_kv_heads,
                       int32_t head_dim, int32_t intermediate, float eps, float scale, DType dtype)
    : layers_(std::move(layers)),
      hidden_(hidden),
      num_heads_(num_heads),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      intermediate_(intermediate),
      eps_(eps),
      scale_(scale),
      dtype_(dtype) {
  const int64_t qkv_width = static_cast<int64_t>(num_heads + 2 * num_kv_heads) * head_dim;
  const int64_t q_width = static_cast<int64_t>(num_heads) * head_dim;
  auto expect = [](const PackedWeight* w, int64_t k, int64_t n, const char* name, size_t layer) {
    PE_CHECK(w != nullptr && w->k() == k && w->n() == n, "layer ", static_cast<int64_t>(layer), " ", name,
             " must be a packed [", k, ", ", n, "] weight");
  };
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LlamaLayerWeights& w = layers_[l];
    expect(w.qkv, hidden, qkv_width, "qkv_proj", l);
    expect(w.o, q_width, hidden, "o_proj", l);
    expect(w.gate_up, hidden, 2 * static_cast<int64_t>(intermediate), "gate_up_proj", l);
    expect(w.down, intermediate, hidden, "down_proj", l);
    PE_CHECK(w.input_norm != nullptr && w.post_norm != nullptr, "layer ", static_cast<int64_t>(l), " lacks a norm weight");
  }
}

std::string LlamaStack::forward(const LlamaStepParams& p) const {
  if (p.k_caches.size() != layers_.size() || p.v_caches.size() != layers_.size())
    return concat("llama stack: ", p.k_caches.size(), " K and ", p.v_caches.size(), " V caches for ", layers_.size(),
                  " layers");
  for (const int32_t a : p.aux_layers)
    if (a < 0 || a > num_layers()) return concat("llama stack: aux layer ", a, " outside 0..", num_layers());
  if (!p.aux_layers.empty() && (p.aux == nullptr || p.aux_row_stride < static_cast<int64_t>(p.aux_layers.size()) * hidden_))
    return concat("llama stack: ", p.aux_layers.size(), " aux layers need aux rows of at least ",
                  static_cast<int64_t>(p.aux_layers.size()) * hidden_, " values");
  if (p.num_tokens <= 0) return {};
  const int64_t t = p.num_tokens, q_width = static_cast<int64_t>(num_heads_) * head_dim_;
  const int64_t qkv_width = static_cast<int64_t>(num_heads_ + 2 * num_kv_heads_) * head_dim_;
  const size_t elem = element_size(dtype_);
  Scratch s(t, hidden_, qkv_width, q_width, intermediate_, elem);

  RmsNormParams norm;
  norm.num_tokens = p.num_tokens, norm.hidden = hidden_, norm.eps = eps_, norm.dtype = dtype_;
  RopeAndCacheParams rope;
  rope.qk = s.qkv, rope.qk_row_stride = qkv_width, rope.positions = p.positions, rope.num_positions = p.num_positions;
  rope.v = s.qkv + static_cast<size_t>(q_width + static_cast<int64_t>(num_kv_heads_) * head_dim_) * elem;
  rope.v_row_stride = qkv_width, rope.cos = p.cos, rope.sin = p.sin, rope.slot_mapping = p.slot_mapping;
  rope.num_slots = p.num_blocks * p.block_size, rope.num_tokens = p.num_tokens, rope.num_heads = num_heads_;
  rope.num_kv_heads = num_kv_heads_, rope.head_dim = head_dim_, rope.dtype = dtype_, rope.use_pool = p.use_pool;
  PagedAttentionParams attn;
  attn.q = s.qkv, attn.q_row_stride = qkv_width, attn.out = s.attn, attn.block_tables = p.block_tables;
  attn.block_table_stride = p.block_table_stride, attn.query_start_loc = p.query_start_loc;
  attn.context_lens = p.context_lens, attn.num_rows = p.num_rows, attn.num_heads = num_heads_;
  attn.num_kv_heads = num_kv_heads_, attn.head_dim = head_dim_, attn.block_size = p.block_size;
  attn.num_blocks = p.num_blocks, attn.scale = scale_, attn.dtype = dtype_, attn.use_pool = p.use_pool;
  attn.avx2_kernel = p.attention_avx2;

  // residual holds the stream at the input of layer l (l = L: before the final norm): into aux's columns
  auto keep_aux = [&](size_t l) {
    for (size_t j = 0; j < p.aux_layers.size(); ++j) {
      if (p.aux_layers[j] != static_cast<int32_t>(l)) continue;
      for (int64_t r = 0; r < t; ++r)
        std::memcpy(static_cast<char*>(p.aux) + static_cast<size_t>(r * p.aux_row_stride + static_cast<int64_t>(j) * hidden_) * elem,
                    static_cast<const char*>(p.residual) + static_cast<size_t>(r * hidden_) * elem,
                    static_cast<size_t>(hidden_) * elem);
    }
  };
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LlamaLayerWeights& w = layers_[l];
    // x = norm(residual) lands in h: the incoming states are not needed after the residual add.
    norm.weight = w.input_norm;
    if (l == 0) {
      std::memcpy(p.residual, p.h, static_cast<size_t>(t * hidden_) * elem);
      norm.x = p.residual, norm.residual = nullptr, norm.out = p.h;
    } else {
      norm.x = p.h, norm.residual = p.residual, norm.out = nullptr;
    }
    if (std::string e = rms_norm(norm); !e.empty()) return e;
    keep_aux(l);
    w.qkv->matmul(p.h, hidden_, t, nullptr, s.qkv);
    rope.k_cache = p.k_caches[l], rope.v_cache = p.v_caches[l];
    if (std::string e = rope_and_cache(rope); !e.empty()) return e;
    attn.k_cache = p.k_caches[l], attn.v_cache = p.v_caches[l];
    if (std::string e = paged_attention(attn); !e.empty()) return e;
    w.o->matmul(s.attn, q_width, t, nullptr, s.o);
    norm.x = s.o, norm.residual = p.residual, norm.out = nullptr, norm.weight = w.post_norm;
    if (std::string e = rms_norm(norm); !e.empty()) return e;
    w.gate_up->matmul(s.o, hidden_, t, nullptr, s.gate_up);
    silu_and_mul(s.gate_up, s.act, p.num_tokens, intermediate_, dtype_, p.use_pool);
    w.down->matmul(s.act, intermediate_, t, nullptr, p.h);
  }
  if (p.final_norm) {
    norm.x = p.h, norm.residual = p.residual, norm.out = nullptr, norm.weight = p.final_norm;
    if (std::string e = rms_norm(norm); !e.empty()) return e;
    keep_aux(layers_.size());
  }
  return {};
}

}  // namespace pyengine::cpu
