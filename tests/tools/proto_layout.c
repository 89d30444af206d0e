/* proto_layout: prints the byte layout of the ring header and the batch slot as the C compiler
 * sees them (offsetof / sizeof of proto/ring.h and proto/batch.h, the constants, and
 * bt_batch_slot_bytes for a few shapes, with bt_batch_view_init's array offsets where a slot is
 * at most 64 MiB, else offsets 0), one JSON object on stdout.
 * tests/py/test_python_client.py checks the Python client's copy (python/barq_loaderd/layout.py)
 * against it, so neither side can drift from the other or from PROTOCOL.md.
 *   proto_layout        (no arguments; exit 0) */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "proto/batch.h"
#include "proto/client.h"
#include "proto/ring.h"

#define RING_FIELD(f) printf("%s\"%s\": %zu", first++ ? ", " : "", #f, offsetof(bt_ring_header, f))
#define BATCH_FIELD(f) printf("%s\"%s\": %zu", first++ ? ", " : "", #f, offsetof(bt_batch_header, f))

int main(void) {
    int first = 0;
    printf("{\"ring_off\": {");
    RING_FIELD(magic); RING_FIELD(version); RING_FIELD(n_slots); RING_FIELD(slot_bytes); RING_FIELD(B);
    RING_FIELD(T); RING_FIELD(total_bytes); RING_FIELD(head); RING_FIELD(head_seq);
    RING_FIELD(consumer_waiting); RING_FIELD(tail); RING_FIELD(tail_seq); RING_FIELD(producer_waiting);
    RING_FIELD(producer_closed); RING_FIELD(consumer_closed);
    first = 0;
    printf("},\n \"batch_off\": {");
    BATCH_FIELD(magic); BATCH_FIELD(layout_version); BATCH_FIELD(job_id); BATCH_FIELD(rank); BATCH_FIELD(step);
    BATCH_FIELD(B); BATCH_FIELD(T); BATCH_FIELD(n_real_tokens); BATCH_FIELD(n_labelled_tokens); BATCH_FIELD(n_cu);
    BATCH_FIELD(n_docs); BATCH_FIELD(flags); BATCH_FIELD(epoch); BATCH_FIELD(checksum); BATCH_FIELD(resume_state);
    printf("},\n \"ring_header_size\": %zu, \"batch_header_size\": %zu,", sizeof(bt_ring_header),
           sizeof(bt_batch_header));
    printf(" \"RING_MAGIC\": %llu, \"RING_VERSION\": %u, \"RING_HEADER_BYTES\": %u,",
           (unsigned long long)BT_RING_MAGIC, BT_RING_VERSION, BT_RING_HEADER_BYTES);
    printf(" \"BATCH_MAGIC\": %u, \"BATCH_LAYOUT_VERSION\": %u, \"RESUME_STATE_BYTES\": %u,", BT_BATCH_MAGIC,
           BT_BATCH_LAYOUT_VERSION, BT_RESUME_STATE_BYTES);
    printf(" \"LABEL_IGNORE\": %d, \"F_END_OF_DATA\": %u, \"PROTO_VERSION\": %d, \"DEFAULT_SOCKET\": \"%s\",\n",
           BT_LABEL_IGNORE, (unsigned)BT_BATCH_F_END_OF_DATA, BT_PROTO_VERSION, BT_DEFAULT_SOCKET);
    static const uint32_t shapes[][2] = {{1, 16}, {2, 64}, {3, 17}, {4, 512}, {7, 1000}, {1, 1u << 20},
                                         {16384, 16384}, {16384, 16385}, {0, 64}, {4, 0}};
    printf(" \"shapes\": [");
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        uint32_t B = shapes[i][0], T = shapes[i][1];
        size_t sb = bt_batch_slot_bytes(B, T);
        size_t o[10] = {0};
        char *slot = sb && sb <= (64u << 20) ? malloc(sb) : NULL; /* offsets only where a slot fits */
        if (slot) {
            bt_batch_view v;
            bt_batch_view_init(&v, slot, B, T);
            o[0] = (size_t)((char *)v.input_ids - slot);
            o[1] = (size_t)((char *)v.labels - slot);
            o[2] = (size_t)((char *)v.position_ids - slot);
            o[3] = (size_t)((char *)v.cu_seqlens - slot);
            o[4] = (size_t)((char *)v.seg_pair - slot);
            o[5] = (size_t)((char *)v.seg_kind - slot);
            o[6] = (size_t)((char *)v.seg_src - slot);
            o[7] = (size_t)((char *)v.seg_line - slot);
            o[8] = (size_t)((char *)v.seg_ref_ok - slot);
            o[9] = (size_t)((char *)v.seg_ref_logp - slot);
            free(slot);
        }
        printf("%s{\"B\": %u, \"T\": %u, \"slot_bytes\": %zu, \"offsets\": [", i ? ", " : "", B, T, sb);
        for (size_t j = 0; j < sizeof o / sizeof o[0]; j++) printf("%s%zu", j ? ", " : "", o[j]);
        printf("]}");
    }
    printf("]}\n");
    return 0;
}
