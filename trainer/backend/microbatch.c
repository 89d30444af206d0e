/* The packed micro-batch's target shift. See microbatch.h. */
#include "trainer/backend/microbatch.h"

#include "common/bt_common.h"

int bt_shift_targets(int32_t *targets, const bt_microbatch *mb, int vocab) {
    if (mb->B < 1 || mb->T < 1 || (int64_t)mb->B * mb->T > (1 << 26))
        return bt_fail(BT_ERR_INVALID, "batch: bad shape B=%d T=%d", mb->B, mb->T);
    int M = mb->B * mb->T;
    const int32_t *cu = mb->cu_seqlens;
    if (mb->n_cu < 2 || mb->n_cu > M + 1 || cu[0] != 0 || cu[mb->n_cu - 1] != M)
        return bt_fail(BT_ERR_INVALID, "batch: cu_seqlens must run from 0 to %d (n_cu %d)", M,
                       mb->n_cu);
    int row_start_ok = 1, next_row = 0;
    for (int i = 0; i < mb->n_cu; i++) {
        if (i > 0 && cu[i] <= cu[i - 1])
            return bt_fail(BT_ERR_INVALID, "batch: cu_seqlens not strictly increasing at %d", i);
        while (next_row * mb->T < cu[i]) {
            row_start_ok = 0; /* a row start was skipped */
            next_row++;
        }
        if (next_row * mb->T == cu[i]) next_row++;
    }
    if (!row_start_ok)
        return bt_fail(BT_ERR_INVALID, "batch: cu_seqlens lacks a row start (segments cross rows)");
    for (int t = 0; t < M; t++) {
        if (mb->input_ids[t] < 0 || mb->input_ids[t] >= vocab)
            return bt_fail(BT_ERR_RANGE, "batch: input_ids[%d] = %d outside [0, %d)", t,
                           mb->input_ids[t], vocab);
        if (mb->labels[t] != -100 && (mb->labels[t] < 0 || mb->labels[t] >= vocab))
            return bt_fail(BT_ERR_RANGE, "batch: labels[%d] = %d outside [0, %d) and not -100", t,
                           mb->labels[t], vocab);
        if (mb->position_ids[t] < 0)
            return bt_fail(BT_ERR_RANGE, "batch: position_ids[%d] = %d < 0", t, mb->position_ids[t]);
    }
    int n = 0, seg = 1; /* cu[seg] is the next boundary after t */
    for (int t = 0; t < M; t++) {
        while (seg < mb->n_cu && cu[seg] <= t) seg++;
        int nxt = t + 1;
        int32_t tg = -100;
        if (nxt < M && nxt % mb->T != 0 && !(seg < mb->n_cu && cu[seg] == nxt))
            tg = mb->labels[nxt];
        if (targets) targets[t] = tg;
        if (tg != -100) n++;
    }
    return n;
}
