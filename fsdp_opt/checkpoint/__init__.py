"""TODO checkpoint"""
