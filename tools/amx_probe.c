/* Exit 0 when this CPU really executes AMX tile instructions (scripts/build-llama-cpp).
 * The kernel must grant the tile state first (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA, Linux Documentation/arch/x86/xstate.rst); a machine that advertises
 * AMX but cannot run it dies here with SIGILL instead of inside llama.cpp. */
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int main(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) return 2;
    unsigned char config[64] = {0};
    config[0] = 1;   /* palette 1 */
    config[16] = 64; /* tile 0: 64 bytes per row */
    config[48] = 16; /* tile 0: 16 rows */
    _tile_loadconfig(config);
    _tile_zero(0);
    _tile_release();
    return 0;
}
