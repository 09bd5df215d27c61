"""The generation log's time bounds (`genlog`), in seconds, on one page: the writer's and the
reader's sides of each bound are one number, so they cannot drift apart.

Liveness: the writer stamps its log's `at` with every write and at least every HEARTBEAT. A
reader checks the stamp every CHECK_EVERY, against Redis's own clock (no two processes'
clocks are ever compared), and declares the writer gone once the stamp is older than
DEAD_AFTER: a dead writer is detected within DETECT_WITHIN, never a hang. The same check
re-registers the reader for READER_TTL, so the writer's stamps count how many readers any
process still has, and a crashed reader stops counting after READER_TTL.

    writer:  stamp --HEARTBEAT-- stamp --HEARTBEAT-- (dies)
    reader:  check -CHECK_EVERY- check ... stamp older than DEAD_AFTER: GenerationLost
"""

from __future__ import annotations

from typing import Final

# The writer stamps its liveness (and recounts its readers) at least this often, also while
# its upstream is quiet: a heartbeat is one small script call per writer, sent with the
# other writers' writes in the process's one round (`publisher`).
HEARTBEAT: Final = 1.0

# A writer whose stamp is older than this, by Redis's clock, is gone: twice HEARTBEAT, so
# one heartbeat late (a busy event loop, a slow round trip) is not a death. The writer
# itself gives up on a Redis that has not taken one of its writes for as long: the same
# silence on either side.
DEAD_AFTER: Final = 2 * HEARTBEAT

# A reader re-registers and checks the writer's stamp this often, however slowly its
# batches are consumed; its blocking reads wait at most this long, so a check is never
# stuck behind a read.
CHECK_EVERY: Final = HEARTBEAT / 2

# How late a dead writer can be noticed: the stamp goes stale after DEAD_AFTER, the next
# check sees it within CHECK_EVERY, and a read blocked meanwhile returns within another.
# Also how long a reader tries Redis again before it gives up ("unavailable").
DETECT_WITHIN: Final = DEAD_AFTER + 2 * CHECK_EVERY

# A reader that stops refreshing (its process crashed) stops counting after this: six of
# its checks, so a reader on a loaded process is not dropped while it still reads.
READER_TTL: Final = 6 * CHECK_EVERY

# A running log's keys live this long after its writer's last stamp: a writer's process
# that died leaves nothing behind for longer, and a live one refreshes them every HEARTBEAT.
TTL: Final = 30.0

# An ended log's keys, kept for late resumes and replays from another process.
LINGER: Final = 60.0

# How often the publisher looks at quiet writers for a due heartbeat: a heartbeat goes at
# most this late.
SWEEP: Final = HEARTBEAT / 4
