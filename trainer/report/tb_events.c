/* TensorBoard scalar event files. See tb_events.h for the format and its sources. */
#include "trainer/report/tb_events.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/bt_common.h"

struct bt_tb_writer {
    FILE *f;
    char *path;
};

uint32_t bt_crc32c(uint32_t crc, const void *p, size_t n) {
    static uint32_t table[256];
    static int ready;
    if (!ready) { /* idempotent: a race only writes the same values twice */
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
            table[i] = c;
        }
        ready = 1;
    }
    const uint8_t *b = p;
    crc = ~crc;
    for (size_t i = 0; i < n; i++) crc = table[(crc ^ b[i]) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

static double wall_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint32_t masked(const void *p, size_t n) {
    uint32_t c = bt_crc32c(0, p, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

/* ---- protobuf wire encoding (developers.google.com/protocol-buffers/docs/encoding) ---- */

typedef struct {
    uint8_t b[512];
    size_t n;
} pbuf;

static void varint(pbuf *p, uint64_t v) {
    do {
        uint8_t c = v & 0x7F;
        v >>= 7;
        p->b[p->n++] = c | (v ? 0x80 : 0);
    } while (v);
}

static void key(pbuf *p, int field, int wire) { varint(p, (uint64_t)field << 3 | (uint64_t)wire); }

static void fixed(pbuf *p, const void *v, size_t n) { /* little-endian hosts (x86-64, aarch64) */
    memcpy(p->b + p->n, v, n);
    p->n += n;
}

static void bytes(pbuf *p, int field, const void *v, size_t n) {
    key(p, field, 2);
    varint(p, n);
    memcpy(p->b + p->n, v, n);
    p->n += n;
}

static int write_record(bt_tb_writer *w, const pbuf *ev) {
    uint64_t len = ev->n;
    uint32_t lc = masked(&len, 8), dc = masked(ev->b, ev->n);
    if (fwrite(&len, 8, 1, w->f) != 1 || fwrite(&lc, 4, 1, w->f) != 1 ||
        fwrite(ev->b, 1, ev->n, w->f) != ev->n || fwrite(&dc, 4, 1, w->f) != 1 || fflush(w->f))
        return bt_fail(BT_ERR_IO, "tensorboard: write %s: %s", w->path, strerror(errno));
    return 0;
}

/* Event header: wall_time (field 1, fixed64 double), step (field 2, varint int64). */
static void event_head(pbuf *p, double wall_time, int64_t step) {
    key(p, 1, 1);
    fixed(p, &wall_time, 8);
    if (step) {
        key(p, 2, 0);
        varint(p, (uint64_t)step);
    }
}

int bt_tb_open(bt_tb_writer **out, const char *dir) {
    *out = NULL;
    char host[256] = "localhost";
    if (gethostname(host, sizeof host - 1) != 0) strcpy(host, "localhost");
    host[sizeof host - 1] = 0;
    for (char *c = host; *c; c++)
        if (*c == '/') *c = '_';
    bt_tb_writer *w = calloc(1, sizeof *w);
    if (!w) return bt_fail(BT_ERR_NOMEM, "tensorboard: out of memory");
    double now = (double)time(NULL);
    if (asprintf(&w->path, "%s/events.out.tfevents.%ld.%s.%d.0", dir, (long)now, host,
                 (int)getpid()) < 0) {
        free(w);
        return bt_fail(BT_ERR_NOMEM, "tensorboard: out of memory");
    }
    w->f = fopen(w->path, "wb");
    if (!w->f) {
        int rc = bt_fail(BT_ERR_IO, "tensorboard: create %s: %s", w->path, strerror(errno));
        free(w->path);
        free(w);
        return rc;
    }
    pbuf p = {.n = 0};
    event_head(&p, wall_now(), 0);
    bytes(&p, 3, "brain.Event:2", 13);
    int rc = write_record(w, &p);
    if (rc) {
        bt_tb_close(w);
        return rc;
    }
    *out = w;
    return 0;
}

int bt_tb_scalar(bt_tb_writer *w, const char *tag, int64_t step, double wall_time, float value) {
    size_t tl = strlen(tag);
    if (tl >= 256) return bt_fail(BT_ERR_INVALID, "tensorboard: tag of %zu bytes", tl);
    pbuf val = {.n = 0}, sum = {.n = 0}, ev = {.n = 0};
    bytes(&val, 1, tag, tl);    /* Summary.Value.tag */
    key(&val, 2, 5);            /* Summary.Value.simple_value (float) */
    fixed(&val, &value, 4);
    bytes(&sum, 1, val.b, val.n); /* Summary.value */
    event_head(&ev, wall_time, step);
    bytes(&ev, 5, sum.b, sum.n);  /* Event.summary */
    return write_record(w, &ev);
}

const char *bt_tb_path(const bt_tb_writer *w) { return w ? w->path : NULL; }

void bt_tb_close(bt_tb_writer *w) {
    if (!w) return;
    if (w->f) fclose(w->f);
    free(w->path);
    free(w);
}
