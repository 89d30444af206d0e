/* The backend operation wrappers. See backend.h. */
#include "trainer/backend/backend.h"

#include <string.h>

#include "common/bt_common.h"

void bt_backend_free(bt_backend *b) {
    if (b) b->iface->free(b);
}

size_t bt_backend_bytes(const bt_backend *b) { return b->iface->bytes(b); }

int bt_backend_device_memory(const bt_backend *b, size_t *held, size_t *peak) {
    *held = *peak = 0;
    if (!b->iface->device_memory) return 0;
    b->iface->device_memory(b, held, peak);
    return 1;
}

int bt_backend_zero_grad(bt_backend *b) { return b->iface->zero_grad(b); }

int bt_backend_step(bt_backend *b, const bt_microbatch *mb, int backward, float grad_scale,
                    uint64_t drop_key, double *loss_sum, int *n_valid) {
    return b->iface->step(b, mb, backward, grad_scale, drop_key, loss_sum, n_valid);
}

int bt_backend_update_params(bt_backend *b, const bt_backend_update *u, double *grad_norm,
                             int64_t *bad_param) {
    return b->iface->update(b, u, grad_norm, bad_param);
}

int bt_backend_allreduce_grads(bt_backend *b) {
    return b->iface->allreduce_grads ? b->iface->allreduce_grads(b) : 0;
}

int bt_backend_allreduce_sum(bt_backend *b, double *vals, int n) {
    return b->iface->allreduce_sum ? b->iface->allreduce_sum(b, vals, n) : 0;
}

int bt_backend_allgather(bt_backend *b, const void *mine, void *all, size_t bytes) {
    if (b->iface->allgather) return b->iface->allgather(b, mine, all, bytes);
    memcpy(all, mine, bytes);
    return 0;
}

void bt_backend_abort(bt_backend *b) {
    if (b && b->iface->abort) b->iface->abort(b);
}

int bt_backend_sync_lora(bt_backend *b, int moments) {
    return b->iface->sync_lora ? b->iface->sync_lora(b, moments) : 0;
}

void bt_backend_set_profile(bt_backend *b, struct bt_prof *p) { b->iface->set_profile(b, p); }

int bt_backend_eval_workspace(bt_backend *b, int max_M, bt_backend **out) {
    *out = NULL;
    return b->iface->eval_workspace(b, max_M, out);
}

int bt_backend_has_logprobs(const bt_backend *b) {
    return b && b->iface->logprobs && b->iface->backward_logprobs;
}

int bt_backend_logprobs(bt_backend *b, const bt_microbatch *mb, int policy, int backward,
                        uint64_t drop_key, float *logp, int *n_valid) {
    if (!bt_backend_has_logprobs(b))
        return bt_fail(BT_ERR_UNSUPPORTED, "this backend has no log-prob pass: preference objectives "
                       "train on device \"cpu\"");
    return b->iface->logprobs(b, mb, policy, backward, drop_key, logp, n_valid);
}

int bt_backend_backward_logprobs(bt_backend *b, const bt_microbatch *mb, const float *dlogp,
                                 uint64_t drop_key) {
    if (!bt_backend_has_logprobs(b))
        return bt_fail(BT_ERR_UNSUPPORTED, "this backend has no log-prob pass: preference objectives "
                       "train on device \"cpu\"");
    return b->iface->backward_logprobs(b, mb, dlogp, drop_key);
}
