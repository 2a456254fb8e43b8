"""`appliance_environ`: variables for the job's workers. Here the input workers
are started by the job's launcher with this process's environment, so a
variable set in it reaches them; it is os.environ."""
import os

appliance_environ = os.environ
