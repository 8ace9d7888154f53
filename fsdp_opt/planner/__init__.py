"""TODO planner"""
