"""A generation's events on Redis, for followers in other processes.

log        GenerationLog: makes a generation's writer and its readers (start here)
writer     LogWriter: publishes one generation (a tee of it: proxy.turn.tee)
publisher  the one task per process that sends every writer's writes
reader     LogReader: follows one generation from any process
store      what writer and reader share: the keys, the scripts' calls (one round trip each)
meta       what a log says (its start, meta, end), parsed; pure
timing     the time bounds both sides keep (heartbeat, dead writer, reader expiry)
scripts    the Lua
"""
