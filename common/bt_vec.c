/* The one growable array (contract: common/bt_vec.h). */
#include "common/bt_vec.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"

void *bt_vec_grow(void *v, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap && v) return v;
    size_t c = *cap < 16 ? 16 : *cap;
    while (c < need) {
        if (c > SIZE_MAX / 2) return NULL;
        c *= 2;
    }
    if (elem && c > SIZE_MAX / elem) return NULL;
    void *n = realloc(v, c * elem);
    if (!n) return NULL;
    *cap = c;
    return n;
}

void *bt_vec_xgrow(void *v, size_t *cap, size_t need, size_t elem) {
    void *n = bt_vec_grow(v, cap, need, elem);
    if (!n) {
        fprintf(stderr, "fatal: out of memory growing an array to %zu elements of %zu bytes\n", need, elem);
        abort();
    }
    return n;
}

int bt_ids_try_append(bt_ids *a, const int32_t *v, size_t k) {
    if (k == 0) return BT_OK;
    if (a->n + k < a->n) return bt_fail(BT_ERR_NOMEM, "token array: %zu + %zu ids overflow", a->n, k);
    int32_t *nv = bt_vec_grow(a->v, &a->cap, a->n + k, sizeof *a->v);
    if (!nv) return bt_fail(BT_ERR_NOMEM, "out of memory for %zu token ids", a->n + k);
    a->v = nv;
    memcpy(a->v + a->n, v, k * sizeof *v);
    a->n += k;
    return BT_OK;
}

int bt_ids_try_push(bt_ids *a, int32_t x) {
    if (a->n < a->cap) {
        a->v[a->n++] = x;
        return BT_OK;
    }
    return bt_ids_try_append(a, &x, 1);
}

void bt_ids_push(bt_ids *a, int32_t x) {
    if (a->n == a->cap) a->v = bt_vec_xgrow(a->v, &a->cap, a->n + 1, sizeof *a->v);
    a->v[a->n++] = x;
}

void bt_ids_free(bt_ids *a) {
    if (!a) return;
    free(a->v);
    a->v = NULL;
    a->n = a->cap = 0;
}

void bt_buf_put(bt_buf *b, const void *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 < b->n) {
        b->oom = 1;
        return;
    }
    char *p = bt_vec_grow(b->p, &b->cap, b->n + n + 1, 1);
    if (!p) {
        b->oom = 1;
        return;
    }
    b->p = p;
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

void bt_buf_str(bt_buf *b, const char *s) { bt_buf_put(b, s, strlen(s)); }

void bt_buf_printf(bt_buf *b, const char *fmt, ...) {
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (k < 0) {
        b->oom = 1;
        return;
    }
    if ((size_t)k < sizeof tmp) {
        bt_buf_put(b, tmp, (size_t)k);
        return;
    }
    char *big = malloc((size_t)k + 1);
    if (!big) {
        b->oom = 1;
        return;
    }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)k + 1, fmt, ap);
    va_end(ap);
    bt_buf_put(b, big, (size_t)k);
    free(big);
}
