import logging

logging.getLogger("shardsafe").setLevel(logging.DEBUG)
