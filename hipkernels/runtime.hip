// Runtime helpers: error strings for the codes the launch functions return.
#include "hip_compat.h"
#include "runtime.h"

const char* pe_error_string(int code) { return peGetErrorString(static_cast<peError_t>(code)); }
