"""Schedules: one IR for every pipeline family, a validator, a simulator and pictures."""
