/* The backend registry: the backends this program was linked with (trainer/backend/backend.h,
 * "Registration"). The CPU backend is always there; the CUDA one is a weak reference, defined
 * when the program links trainer/cuda/backend_cuda.o (the CUDA trainer) and NULL otherwise. */
#include "common/bt_common.h"
#include "trainer/backend/backend.h"

extern const bt_backend_reg bt_backend_cuda_reg __attribute__((weak));

const bt_backend_reg *bt_backend_find(int device) {
    const bt_backend_reg *const regs[] = {&bt_backend_cpu_reg, &bt_backend_cuda_reg};
    for (size_t i = 0; i < sizeof regs / sizeof regs[0]; i++)
        if (regs[i] && regs[i]->device == device) return regs[i];
    return NULL;
}

int bt_backend_get(int device, const bt_backend_reg **reg) {
    if ((*reg = bt_backend_find(device))) return 0;
    if (device == BT_DEVICE_CUDA)
        return bt_fail(BT_ERR_UNSUPPORTED, "config: device: \"cuda\": this trainer was built "
                       "without CUDA (make CUDA=1)");
    return bt_fail(BT_ERR_INVALID, "config: device: no backend %d", device);
}
