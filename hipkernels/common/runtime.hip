// Runtime helpers: error strings for the codes the launch functions return, and the per-step copy.
#include "common/hip_compat.h"
#include "common/runtime.h"

const char* pe_error_string(int code) { return peGetErrorString(static_cast<peError_t>(code)); }

int pe_copy_async(void* dst, const void* src, size_t bytes, void* event, void* stream) {
  const peStream_t s = static_cast<peStream_t>(stream);
  peError_t rc = bytes ? peMemcpyAsync(dst, src, bytes, peMemcpyDefault, s) : peSuccess;
  if (rc == peSuccess && event != nullptr) rc = peEventRecord(static_cast<peEvent_t>(event), s);
  return static_cast<int>(rc);
}
