/* The CPU's matrix units (Intel AMX: eight tiles of 16 rows x 64 bytes, TDPBSSD multiplies int8 tiles into int32):
 * whether the CPU reports them, the process's permission to use their state, and one tile product checked against
 * plain C. Linux enables the tile state per process on request (arch_prctl ARCH_REQ_XCOMP_PERM); a process that
 * did not ask, or a hypervisor that does not pass the state through, gets SIGILL on the first tile instruction, so
 * the check runs in a child process (native/matrix_units.py) and the server only ever asks these questions. */
#define _GNU_SOURCE /* syscall(), which -std=c11 leaves undeclared (an error from gcc 14 on) */
#include "kernels.h"

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_ROWS 16  /* rows of a tile */
#define AMX_BYTES 64 /* bytes of a tile's row */

/* 1 where CPUID reports AMX-TILE and AMX-INT8 (leaf 7, EDX bits 24 and 25) */
int tm_amx_reported(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    return (d >> 24 & 1) && (d >> 25 & 1);
}

/* asks Linux for the tile state: 0 granted, -1 refused (no AMX, a kernel before 5.16, or a hypervisor without it),
 * -2 the permission could not be read back, -3 it reads back without the tile data */
int tm_amx_request(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) return -1;
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &granted)) return -2;
    return granted >> XFEATURE_XTILEDATA & 1 ? 0 : -3;
}

/* the tile configuration (palette 1): per tile its bytes a row and its rows */
typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t row_bytes[16];
    uint8_t rows[16];
} tile_config;

/* One product C [16][16] int32 = A [16][64] int8 . B, B in the tiles' layout ([16][64]: row k holds column n's
 * inputs 4k..4k+3 at bytes 4n..4n+3), checked against the same sums in C: 0 right, 1 wrong. Runs tile
 * instructions: only in a process that was granted the tile state (else SIGILL). */
__attribute__((target("amx-tile,amx-int8"))) int tm_amx_tile_check(void) {
    int8_t a[AMX_ROWS][AMX_BYTES], b[AMX_ROWS][AMX_BYTES];
    int32_t c[AMX_ROWS][AMX_ROWS], want[AMX_ROWS][AMX_ROWS];
    for (int i = 0; i < AMX_ROWS; ++i)
        for (int j = 0; j < AMX_BYTES; ++j) {
            a[i][j] = (int8_t)((i * 37 + j * 11) % 255 - 127);
            b[i][j] = (int8_t)((i * 13 + j * 29 + 5) % 255 - 127);
        }
    for (int m = 0; m < AMX_ROWS; ++m)
        for (int n = 0; n < AMX_ROWS; ++n) {
            int32_t s = 0;
            for (int k = 0; k < AMX_ROWS; ++k)
                for (int i = 0; i < 4; ++i) s += a[m][4 * k + i] * b[k][4 * n + i];
            want[m][n] = s;
        }
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 3; ++t) { /* tile 0: C, 1: A, 2: B; each 16 rows of 64 bytes */
        cfg.row_bytes[t] = AMX_BYTES;
        cfg.rows[t] = AMX_ROWS;
    }
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_loadd(1, a, AMX_BYTES);
    _tile_loadd(2, b, AMX_BYTES);
    _tile_dpbssd(0, 1, 2);
    _tile_stored(0, c, AMX_ROWS * sizeof(int32_t));
    _tile_release();
    return memcmp(c, want, sizeof c) != 0;
}
#else
int tm_amx_reported(void) { return 0; }
int tm_amx_request(void) { return -1; }
int tm_amx_tile_check(void) { return 1; }
#endif
