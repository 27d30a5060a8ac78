// Runtime helpers: error strings for the codes the launch functions return.
#include "common/hip_compat.h"
#include "common/runtime.h"

const char* pe_error_string(int code) { return peGetErrorString(static_cast<peError_t>(code)); }
