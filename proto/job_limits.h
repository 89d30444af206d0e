/* Limits of the job spec loaderd accepts at attach (proto/PROTOCOL.md "attach"; enforced by
 * loaderd/job.c). Clients check the same values up front from this one definition, so that a
 * job `trainer config --check` passes is one loaderd takes (trainer/config.c). */
#ifndef BT_PROTO_JOB_LIMITS_H
#define BT_PROTO_JOB_LIMITS_H

#define BT_JOB_MIN_SEQ_LEN 16u            /* "seq_len" in [BT_JOB_MIN_SEQ_LEN, BT_JOB_MAX_SEQ_LEN] */
#define BT_JOB_MAX_SEQ_LEN (1u << 20)
#define BT_JOB_MAX_BATCH_TOKENS (1u << 24) /* "micro_batch_size" x "seq_len" at most this */
#define BT_JOB_MAX_TOKENIZER_THREADS 256u  /* "tokenizer_threads" in [1, this] */
#define BT_JOB_MAX_SHARD_PATTERNS 100000u  /* "shards": 1 .. this many glob patterns */

#endif
