"""TODO hub"""
