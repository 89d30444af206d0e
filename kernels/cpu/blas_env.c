/* OpenBLAS kernel selection for CPUs that OpenBLAS 0.3.21 (Debian 12) does not recognise.
 *
 * OpenBLAS's DYNAMIC_ARCH build picks its sgemm kernels from the CPUID family/model when the
 * library is loaded. For CPUs newer than the release (e.g. Sapphire Rapids, family 6 model 207,
 * the machines this project is tested on) it falls back to the generic "Prescott" kernels:
 * measured 21 GFLOP/s versus 120-165 GFLOP/s with the SkylakeX (AVX-512) kernels on the same
 * core (kernels/cpu bench, 2048x576x1536 sgemm). The choice can only be overridden with the
 * OPENBLAS_CORETYPE environment variable, read once at load time (OpenBLAS
 * driver/others/dynamic.c, get_coretype/force_coretype), so a process must set it and re-exec
 * itself before any BLAS work.
 *
 * The same re-exec sets OMP_WAIT_POLICY=passive where the user has not chosen a policy: libgomp
 * (GCC 12) reads it once at load time too (libgomp env.c, initialize_env). Its default spins at
 * every barrier of the ~1,800 parallel regions of a training step; on a node where loaderd's
 * threads, a second rank or another job share the cores, a spinning thread takes the core the
 * thread it waits for needs. Measured 2026-11-27 on the 2-core machine (load 3-10): 2 cached DPO
 * steps 31.3-38.9 CPU s spinning vs 15.0-17.8 passive, equal losses; 2 Gemma 3 270M steps + 2
 * held-out batches 74.6 vs 43.9 CPU s, equal losses. */
#include "kernels/kernels.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const char *bt_openblas_coretype_for_cpu(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return "SkylakeX";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return "Haswell";
    return NULL;
}

void bt_openblas_env_reexec(char **argv)
{
    if (getenv("BT_NO_BLAS_REEXEC"))
        return;
    int again = 0;
    const char *ct = getenv("OPENBLAS_CORETYPE") ? NULL : bt_openblas_coretype_for_cpu();
    if (ct) {
        setenv("OPENBLAS_CORETYPE", ct, 1);
        again = 1;
    }
    if (!getenv("OMP_WAIT_POLICY")) {
        setenv("OMP_WAIT_POLICY", "passive", 1);
        again = 1;
    }
    if (!again)
        return;
    execv("/proc/self/exe", argv);
    /* exec failed (no /proc): carry on with the libraries' own choices, which are only slower */
    fprintf(stderr, "warning: could not re-exec with OPENBLAS_CORETYPE=%s OMP_WAIT_POLICY=%s; the CPU backend "
            "may be slow\n", getenv("OPENBLAS_CORETYPE") ? getenv("OPENBLAS_CORETYPE") : "(unset)",
            getenv("OMP_WAIT_POLICY"));
}
