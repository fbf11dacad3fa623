"""Synthetic scenarios that write real trace databases (ingero demo, investigations/)."""
