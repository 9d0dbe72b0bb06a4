"""Fleets of fleetd nodes: nodes files, SSH (paramiko) control and deploy, A/B runs."""
