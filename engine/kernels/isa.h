// The instruction set a library of the engine's CPU kernels is built for, and its ops' names.
//
// engine/kernels/__init__.py compiles the same sources once per instruction set, with that
// set's compiler flags and one of -DDS4_ISA_AMX, -DDS4_ISA_AVX512, -DDS4_ISA_AVX2 (none: the
// portable build).  Each op is registered as ds4::<name>_<isa> (ds4::int4_linear_avx2, ...),
// so libraries built for different instruction sets load side by side in one process and the
// engine picks among them at run time.
#pragma once

#if defined(DS4_ISA_AMX)
#define DS4_ISA "amx"
#elif defined(DS4_ISA_AVX512)
#define DS4_ISA "avx512"
#elif defined(DS4_ISA_AVX2)
#define DS4_ISA "avx2"
#else
#define DS4_ISA "portable"
#endif

// "int4_linear" -> "int4_linear_avx2" (a string literal, for schemas and registrations)
#define DS4_OP(name) name "_" DS4_ISA

// An op's entry point that another op also calls (block.cpp): compiled once, never inlined into
// or cloned for a caller, so that both compute the same bits.  Inlined, the same source can
// compile to other arithmetic: GCC contracts a * b + c into a fused multiply-add, or not,
// depending on the code around it.
#define DS4_ENTRY __attribute__((noipa))
