"""Reaching a host: one SSH connection (paramiko) or this machine, ssh_config as OpenSSH reads it, docker exec."""
