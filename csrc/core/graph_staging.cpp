#include "graph_staging.h"

#include <algorithm>
#include <cstring>

#include "common/common.h"

namespace pyengine {

void stage_graph_step(const GraphStagingBuffers& buf, const GraphStepInputs& in, int64_t padded_rows, int64_t q,
                      int64_t token_slots) {
  const int64_t T = buf.T, R = buf.R, rows = in.rows;
  const int64_t n = in.query_start_loc[rows];
  PE_CHECK(rows <= padded_rows && padded_rows <= R, "stage_graph_step: ", rows, " rows for ", padded_rows,
           " padded rows of ", R);
  PE_CHECK(n >= 0 && n <= token_slots && token_slots <= T, "stage_graph_step: ", n, " tokens for ", token_slots,
           " slots of ", T);
  PE_CHECK(in.table_width <= buf.width, "stage_graph_step: block tables of width ", in.table_width, " exceed ",
           buf.width);
  int64_t* ids = buf.h64;
  int64_t* pos = buf.h64 + T;
  int64_t* slots = buf.h64 + 2 * T;
  int64_t* ctx = buf.h64 + 3 * T;
  int64_t* qsl = buf.h64 + 3 * T + R;
  if (in.input_ids != nullptr) std::memcpy(ids, in.input_ids, n * sizeof(int64_t));
  std::memcpy(pos, in.positions, n * sizeof(int64_t));
  std::memcpy(slots, in.slot_mapping, n * sizeof(int64_t));
  std::copy(in.context_lens, in.context_lens + rows, ctx);
  std::copy(in.query_start_loc, in.query_start_loc + rows + 1, qsl);
  std::fill(ids + n, ids + token_slots, 0);
  std::fill(pos + n, pos + token_slots, 0);
  std::fill(slots + n, slots + token_slots, -1);  // no KV write
  std::fill(ctx + rows, ctx + padded_rows, 0);     // no keys read
  for (int64_t r = rows; r < padded_rows; ++r) qsl[r + 1] = std::min(n + q * (r - rows + 1), token_slots);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(in.block_tables + r * in.table_width, in.block_tables + (r + 1) * in.table_width,
              buf.tables + r * buf.width);
  }
}

bool launch_rows(const int64_t* first, const int32_t* counts, int64_t rows, const int32_t* tables, int64_t width,
                 int64_t block_size, int64_t max_context, LaunchRows* out) {
  out->query_start_loc.assign(rows + 1, 0);
  for (int64_t r = 0; r < rows; ++r) out->query_start_loc[r + 1] = out->query_start_loc[r] + counts[r];
  const int64_t n = out->query_start_loc[rows];
  out->positions.resize(n);
  out->slot_mapping.resize(n);
  out->context_lens.resize(rows);
  out->num_blocks.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t ctx = first[r] + counts[r];
    if (counts[r] < 1 || first[r] < 0 || ctx > max_context) return false;
    for (int64_t j = 0, t = out->query_start_loc[r]; j < counts[r]; ++j, ++t) {
      const int64_t p = first[r] + j, col = p / block_size;
      if (col >= width) return false;
      const int32_t block = tables[r * width + col];
      if (block < 0) return false;  // no block there yet
      out->positions[t] = p;
      out->slot_mapping[t] = static_cast<int64_t>(block) * block_size + p % block_size;
    }
    out->context_lens[r] = static_cast<int32_t>(ctx);
    out->num_blocks[r] = (ctx - 1) / block_size + 1;
  }
  return true;
}

}  // namespace pyengine
