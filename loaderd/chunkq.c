/* loaderd ordered tokenize queue (contract: loaderd/chunkq.h). */
#include "loaderd/chunkq.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/bt_common.h"
#include "common/bt_vec.h"
#include "loaderd/job.h"

enum { SLOT_EMPTY = 0, SLOT_PRODUCER, SLOT_FILLED, SLOT_WORKING, SLOT_DONE };

struct ld_chunkq {
    pthread_mutex_t mu;
    pthread_cond_t cv_producer, cv_worker, cv_consumer;
    ld_chunk *ring;
    size_t Q;
    uint64_t next_fill, next_take;
    int stop, finished, fatal;
    int take_cancelled; /* ld_chunkq_cancel_take */
    char fatal_msg[600];
    pthread_t *workers;
    uint32_t n_workers;
    ld_item_fn fn;
    void *ctx;
};

static int needs_work(const ld_chunk *c) {
    for (size_t i = 0; i < c->n; i++)
        if (!c->items[i].ready) return 1;
    return 0;
}

static int work_chunk(ld_chunkq *q, ld_chunk *c) {
    for (size_t i = 0; i < c->n; i++) {
        ld_item *it = &c->items[i];
        if (it->ready) continue;
        int rc = q->fn(q->ctx, it, c->text + it->off);
        if (rc < 0) return rc;
        it->ready = 1;
    }
    return BT_OK;
}

/* The FILLED chunk with the lowest sequence number (under mu), NULL if none. */
static ld_chunk *next_filled(ld_chunkq *q) {
    ld_chunk *best = NULL;
    for (size_t i = 0; i < q->Q; i++) {
        ld_chunk *c = &q->ring[i];
        if (c->state == SLOT_FILLED && (!best || c->seq < best->seq)) best = c;
    }
    return best;
}

static void *worker_main(void *arg) {
    ld_chunkq *q = arg;
    for (;;) {
        pthread_mutex_lock(&q->mu);
        ld_chunk *c = NULL;
        while (!q->stop && !q->fatal && !(c = next_filled(q))) pthread_cond_wait(&q->cv_worker, &q->mu);
        if (q->stop || q->fatal) {
            pthread_mutex_unlock(&q->mu);
            return NULL;
        }
        c->state = SLOT_WORKING;
        pthread_mutex_unlock(&q->mu);
        int rc = work_chunk(q, c);
        if (rc < 0) {
            char msg[600];
            snprintf(msg, sizeof msg, "tokenize worker: %s", bt_last_error());
            ld_chunkq_fail(q, rc, msg);
            return NULL;
        }
        pthread_mutex_lock(&q->mu);
        c->state = SLOT_DONE;
        pthread_cond_broadcast(&q->cv_consumer);
        pthread_mutex_unlock(&q->mu);
    }
}

int ld_chunkq_new(ld_chunkq **out, uint32_t n_threads, ld_item_fn fn, void *ctx) {
    *out = NULL;
    ld_chunkq *q = bt_xcalloc(1, sizeof *q);
    if (n_threads < 1) n_threads = 1;
    q->fn = fn;
    q->ctx = ctx;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv_producer, NULL);
    pthread_cond_init(&q->cv_worker, NULL);
    pthread_cond_init(&q->cv_consumer, NULL);
    q->Q = 2 * (size_t)n_threads + 2;
    q->ring = bt_xcalloc(q->Q, sizeof *q->ring);
    q->workers = bt_xcalloc(n_threads, sizeof *q->workers);
    for (uint32_t i = 0; i < n_threads; i++) {
        if (pthread_create(&q->workers[i], NULL, worker_main, q) != 0) {
            ld_chunkq_free(q);
            return bt_fail(BT_ERR_NOMEM, "tokenize queue: cannot start tokenize thread %u", i);
        }
        q->n_workers++;
    }
    *out = q;
    return BT_OK;
}

ld_chunk *ld_chunkq_claim(ld_chunkq *q) {
    pthread_mutex_lock(&q->mu);
    ld_chunk *c = &q->ring[q->next_fill % q->Q];
    while (c->state != SLOT_EMPTY && !q->stop && !q->fatal) pthread_cond_wait(&q->cv_producer, &q->mu);
    if (q->stop || q->fatal) {
        pthread_mutex_unlock(&q->mu);
        return NULL;
    }
    c->state = SLOT_PRODUCER;
    c->seq = q->next_fill;
    pthread_mutex_unlock(&q->mu);
    c->epoch = 0;
    c->end_epoch = c->last = 0;
    c->n = c->tlen = 0;
    return c;
}

ld_item *ld_chunk_add(ld_chunk *c, const char *line, size_t len) {
    if (c->n == c->cap) c->items = bt_vec_xgrow(c->items, &c->cap, c->n < LD_CHUNK_LINES ? LD_CHUNK_LINES : c->n + 1,
                                                sizeof *c->items);
    ld_item *it = &c->items[c->n++];
    memset(it, 0, sizeof *it);
    it->pre_bad = it->bad = -1;
    if (c->tlen + len > c->tcap) { /* a line (up to LD_SOURCE_MAX_LINE): fallible */
        char *t = bt_vec_grow(c->text, &c->tcap, c->tlen + len < 64 * 1024 ? 64 * 1024 : c->tlen + len, 1);
        if (!t) {
            it->off = c->tlen;
            it->ready = 1;
            it->bad = it->pre_bad = LD_BAD_MEMORY;
            snprintf(it->msg, sizeof it->msg, "out of memory copying a line of %zu bytes: skipped", len);
            return it;
        }
        c->text = t;
    }
    it->off = c->tlen;
    it->len = len;
    if (len) memcpy(c->text + c->tlen, line, len);
    c->tlen += len;
    return it;
}

void ld_chunkq_publish(ld_chunkq *q, ld_chunk *c) {
    int work = needs_work(c);
    pthread_mutex_lock(&q->mu);
    c->state = work ? SLOT_FILLED : SLOT_DONE;
    q->next_fill++;
    if (work) pthread_cond_signal(&q->cv_worker);
    else pthread_cond_broadcast(&q->cv_consumer);
    pthread_mutex_unlock(&q->mu);
}

void ld_chunkq_finish(ld_chunkq *q) {
    pthread_mutex_lock(&q->mu);
    q->finished = 1;
    pthread_cond_broadcast(&q->cv_consumer);
    pthread_mutex_unlock(&q->mu);
}

void ld_chunkq_fail(ld_chunkq *q, int code, const char *msg) {
    pthread_mutex_lock(&q->mu);
    if (!q->fatal) {
        q->fatal = code < 0 ? code : BT_ERR_IO;
        snprintf(q->fatal_msg, sizeof q->fatal_msg, "%s", msg);
    }
    pthread_cond_broadcast(&q->cv_producer);
    pthread_cond_broadcast(&q->cv_worker);
    pthread_cond_broadcast(&q->cv_consumer);
    pthread_mutex_unlock(&q->mu);
}

int ld_chunkq_take(ld_chunkq *q, ld_chunk **out) {
    *out = NULL;
    pthread_mutex_lock(&q->mu);
    ld_chunk *c = &q->ring[q->next_take % q->Q];
    for (;;) {
        if (q->fatal) {
            int code = q->fatal;
            char msg[600];
            snprintf(msg, sizeof msg, "%s", q->fatal_msg);
            pthread_mutex_unlock(&q->mu);
            return bt_fail(code, "%s", msg);
        }
        if (q->stop) {
            pthread_mutex_unlock(&q->mu);
            return bt_fail(BT_ERR_IO, "tokenize queue stopped");
        }
        if (q->take_cancelled) {
            pthread_mutex_unlock(&q->mu);
            return bt_fail(BT_ERR_CLOSED, "cancelled");
        }
        if (c->state == SLOT_DONE && c->seq == q->next_take) break;
        if (q->finished && q->next_take == q->next_fill) {
            pthread_mutex_unlock(&q->mu);
            return 1;
        }
        pthread_cond_wait(&q->cv_consumer, &q->mu);
    }
    pthread_mutex_unlock(&q->mu);
    *out = c;
    return 0;
}

static void chunk_clear(ld_chunk *c) {
    for (size_t i = 0; i < c->n; i++) {
        bt_ids_free(&c->items[i].ids);
        bt_ids_free(&c->items[i].mask);
    }
    c->n = c->tlen = 0;
}

void ld_chunkq_release(ld_chunkq *q, ld_chunk *c) {
    chunk_clear(c);
    pthread_mutex_lock(&q->mu);
    c->state = SLOT_EMPTY;
    q->next_take++;
    pthread_cond_signal(&q->cv_producer);
    pthread_mutex_unlock(&q->mu);
}

void ld_chunkq_cancel_take(ld_chunkq *q) {
    pthread_mutex_lock(&q->mu);
    q->take_cancelled = 1;
    pthread_cond_broadcast(&q->cv_consumer);
    pthread_mutex_unlock(&q->mu);
}

void ld_chunkq_stop(ld_chunkq *q) {
    pthread_mutex_lock(&q->mu);
    q->stop = 1;
    pthread_cond_broadcast(&q->cv_producer);
    pthread_cond_broadcast(&q->cv_worker);
    pthread_cond_broadcast(&q->cv_consumer);
    pthread_mutex_unlock(&q->mu);
    for (uint32_t i = 0; i < q->n_workers; i++) pthread_join(q->workers[i], NULL);
    q->n_workers = 0;
}

void ld_chunkq_free(ld_chunkq *q) {
    if (!q) return;
    ld_chunkq_stop(q);
    for (size_t i = 0; i < q->Q; i++) {
        chunk_clear(&q->ring[i]);
        free(q->ring[i].items);
        free(q->ring[i].text);
    }
    free(q->ring);
    free(q->workers);
    pthread_cond_destroy(&q->cv_producer);
    pthread_cond_destroy(&q->cv_worker);
    pthread_cond_destroy(&q->cv_consumer);
    pthread_mutex_destroy(&q->mu);
    free(q);
}
