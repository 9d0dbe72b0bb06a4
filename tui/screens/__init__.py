"""The app's screens: the dashboard (nodes and live counters) and the A/B runner."""
