"""Defaults of ``asyncsess serve`` shared by the command and the doors (light: no FastAPI import)."""

POLL_TIMEOUT = 30.0  # seconds a retrieve_future long-poll is held before answering 408
SESSION_TIMEOUT = 300.0  # seconds without a heartbeat (the tinker SDK sends one every 10 s) before a session expires
MAX_SAMPLERS = 16  # samplers one session keeps open on the backend; the least recently used idle one past it is closed
MAX_PENDING = 8192  # unfinished requests (futures) one API key may hold on the Tinker door; past it a 429 (the SDK retries)
MAX_LIVE_PER_KEY = 256  # models plus open samplers one API key may hold on the Tinker door (as the worker's max_live_per_key)
MAX_SESSIONS_PER_KEY = 1_024  # unfinished sessions one API key may hold on the Tinker door
MAX_FINISHED_PER_KEY = 4_096  # finished sessions without checkpoints the door keeps listing per key (older ones forgotten)
MAX_DELETED_PATHS_PER_KEY = 4_096  # backend paths of one key's deleted checkpoints not naming their model (ARNs) kept as 404s
MAX_FORGOTTEN_PATHS_PER_KEY = 4_096  # backend ids of one key's forgotten models (paths naming them: 404s) the door keeps
