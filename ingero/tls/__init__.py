"""Certificates (``pki``) and SSL contexts (``context``) used by the agent server, the fleet client and ``ingero cert``."""
