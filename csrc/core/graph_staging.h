// A decode/verify step's inputs written into CudaGraphRunner's host staging buffers
// (pyengine/engine/cuda_graph_runner.py, _stage), padding rows included: one C++ pass instead of
// ~15 NumPy slice writes on the host's critical path before each replay.
#pragma once

#include <cstdint>
#include <vector>

namespace pyengine {

// int64 [input_ids T | positions T | slots T | context_lens R | query_start_loc R + 1] and the int32
// block tables [R, width], row-major.
struct GraphStagingBuffers {
  int64_t* h64;
  int32_t* tables;
  int64_t T, R, width;
};

struct GraphStepInputs {
  int64_t rows;                    // the step's rows; padding rows follow up to padded_rows
  const int32_t* query_start_loc;  // rows + 1
  const int64_t* input_ids;        // query_start_loc[rows] tokens; nullptr: left as they are
  const int64_t* positions;
  const int64_t* slot_mapping;
  const int32_t* context_lens;  // rows
  const int32_t* block_tables;  // rows x table_width
  int64_t table_width;
};

// padded_rows (2b), q and token_slots: the graph's shape (graph_capture.graph_shape). Padding rows
// own the token slots after the step's tokens, q at most each (then none), with slot -1 (no KV
// write) and context 0 (no keys read).
void stage_graph_step(const GraphStagingBuffers& buf, const GraphStepInputs& in, int64_t padded_rows, int64_t q,
                      int64_t token_slots);

// A step launched ahead (CudaGraphRunner._launch): row r feeds counts[r] tokens from position
// first[r] on, in the blocks its table row (width entries) holds. Fills query_start_loc (rows + 1),
// positions and slot_mapping (the step's tokens), context_lens and num_blocks (the table entries
// each row's context spans) and returns true; false where a position's block is missing (-1 or past
// the table) or a context exceeds max_context (nothing launched).
struct LaunchRows {
  std::vector<int64_t> query_start_loc, positions, slot_mapping, num_blocks;
  std::vector<int32_t> context_lens;
};
bool launch_rows(const int64_t* first, const int32_t* counts, int64_t rows, const int32_t* tables, int64_t width,
                 int64_t block_size, int64_t max_context, LaunchRows* out);

}  // namespace pyengine
