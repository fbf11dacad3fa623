"""``ingero dashboard``: an HTTPS browser view of one database or a whole fleet, reading through the
tool registry (:mod:`ingero.dashboard.app`); its assets, uPlot included, are served from this package."""
