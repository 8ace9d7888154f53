"""TODO engine"""
