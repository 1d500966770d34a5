// The emulator and every kernel in one translation unit: the kernels register themselves with the
// emulator from static initialisers, which a static library would drop from a separate object
// nobody references.
#define LAZARUS_EMULATE
#include "emulate.cpp"
#include "../cuda/kernels.cu"
