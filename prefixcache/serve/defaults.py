"""The server's defaults, in one place: `serve`, `decide`, Ray Serve and Ray Data take them from
here, and the command line shows them. No torch here."""

BATCH_WAIT_MS = 25.0  # under load, how long a forward pass waits for more requests to join it
MAX_BATCH = 16  # requests in one forward pass at most
PREFIXES = 16  # prefilled prefixes kept in memory (more are read back from the prefix store on disk)
PACKS = 64  # question packs kept (their tokenised options, calibration), each holding one of those prefixes
RECENT, RECENT_S = 256, 30.0  # answers kept to answer an identical request (a client's retry) again, and for how long
