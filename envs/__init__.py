"""Simulator and gymnasium environments (see ARCHITECTURE in the README)."""
