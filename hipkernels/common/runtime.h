// Small runtime helpers shared by the kernel bindings (plain C++ interface).
#pragma once

const char* pe_error_string(int code);
