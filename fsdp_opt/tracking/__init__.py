"""TODO tracking"""
