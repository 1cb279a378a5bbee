"""Create the shared result-storage block the workers use for Prefect's task cache (run once).

Credentials are not stored in the block: s3fs reads AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and
AWS_ENDPOINT_URL_S3 from each worker's environment. Usage: python infra/results-block.py s3://bucket/prefect
"""

import sys

from prefect.filesystems import RemoteFileSystem

if __name__ == "__main__":
    RemoteFileSystem(basepath=sys.argv[1]).save("eagle3-results", overwrite=True)
    print("saved remote-file-system/eagle3-results ->", sys.argv[1])
