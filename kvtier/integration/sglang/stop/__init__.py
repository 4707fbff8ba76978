"""Stopping a server with kvtier, bounded: the HTTP grace (`http_stop`), each scheduler's
drain (`shutdown`), the launcher's wait for the drains (`stop_wait`)."""
