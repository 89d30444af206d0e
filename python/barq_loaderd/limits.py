"""Limits of the job spec loaderd accepts at attach: the Python copy of proto/job_limits.h (the one
definition; tests/py/test_python_client.py::test_limits_match_the_c_header checks every value
against the header, so the two cannot drift)."""

JOB_MIN_SEQ_LEN = 16             # BT_JOB_MIN_SEQ_LEN: "seq_len" in [JOB_MIN_SEQ_LEN, JOB_MAX_SEQ_LEN]
JOB_MAX_SEQ_LEN = 1 << 20        # BT_JOB_MAX_SEQ_LEN
JOB_MAX_BATCH_TOKENS = 1 << 24   # BT_JOB_MAX_BATCH_TOKENS: micro_batch_size x seq_len at most this
JOB_MAX_TOKENIZER_THREADS = 256  # BT_JOB_MAX_TOKENIZER_THREADS
JOB_MAX_SHARD_PATTERNS = 100000  # BT_JOB_MAX_SHARD_PATTERNS
