"""Helpers of the appliance client the model zoo imports (units, debug args, ini, files, classes)."""
