"""`dilaserve bench`: a live, open-loop load generator for a running OpenAI-compatible server."""
