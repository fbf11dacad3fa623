"""Fleet client: node list, concurrent fan-out over HTTPS, clock skew, merge and straggler verdict."""
