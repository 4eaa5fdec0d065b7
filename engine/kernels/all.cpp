// Every kernel source in one translation unit, so that a library is one compilation: most of a
// build's time goes to parsing torch's headers, once per unit.  Each source keeps its code in
// its own namespace and registers its own ops (isa.h names them for the instruction set).
#include "decode_attention.cpp"
#include "elementwise.cpp"
#include "dense_linear.cpp"
#include "int4_linear.cpp"
#include "repack.cpp"
#include "block.cpp"  // last: it calls the ops above
